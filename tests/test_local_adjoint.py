"""Margin gradients over a ball from the adjoint graph (lsa_models/engine/derived/adjoint.py): the
graph must compute J_F(X)^T c exactly (against autodiff), and its bound on the gradient's dual
norm must never be below the exact float64 gradient's at points of the ball (random points,
corners, ascent on the norm); the l1 relaxation must enclose every realisation of a form."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.engine.affine.form import Aff
from lsa_models.engine.derived.adjoint import AdjointGraph
from lsa_models.engine.derived.dual_norms import l1_sup, l2_sup
from lsa_models.engine.routes import sweep
from lsa_models.engine.routes.certify import certify_local, robustness
from lsa_models.engine.values import Ball
from lsa_models.onnx import load_onnx
from lsa_models.onnx.loading import OnnxModel
from tests.profile import at_most
from tests.test_local_tangent import _jac, _models


@pytest.fixture
def models() -> dict[str, tuple[OnnxModel, np.ndarray]]:
    return _models()


def _weights(om: OnnxModel, x0: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    k = _jac(om, x0).shape[0]
    c = np.zeros(k)
    i, j = rng.choice(k, size=2, replace=False)
    c[i], c[j] = 1.0, -1.0  # a margin f_i - f_j
    return c


@pytest.mark.parametrize("kind", ["mlp", "tf1", "researcher", "relu"])
def test_adjoint_graph_computes_the_vector_jacobian_product(models, kind: str) -> None:
    om, x0 = models[kind]
    rng = np.random.default_rng(0)
    c = rng.standard_normal(_jac(om, x0).shape[0])
    ag = AdjointGraph(om, x0, c)
    for _ in range(3):
        x = x0 + 0.3 * rng.standard_normal(x0.shape)
        want = c @ _jac(om, x)
        np.testing.assert_allclose(ag.vjp(x).reshape(-1), want, rtol=1e-9, atol=1e-12)
    # the written-out GELU is walked as one function, its derivative as another
    assert (len(ag.chains) > 0) == (kind in ("mlp", "tf1"))


def _hunt(om: OnnxModel, x0: np.ndarray, c: np.ndarray, eps: float, norm: str,
          rng: np.random.Generator) -> list[np.ndarray]:
    """Points of the ball where the gradient's dual norm is large: random points, corners
    (inf) and projected ascent on the norm from the centre and a random point."""
    f64 = om.module.with_dtype(torch.float64)
    ct = torch.from_numpy(c)
    x0t = torch.from_numpy(x0)

    def project(x: torch.Tensor) -> torch.Tensor:
        if norm == "inf":
            return torch.clamp(x, x0t - eps, x0t + eps)
        d = x - x0t
        n = float(d.norm())
        return x0t + d * min(1.0, eps / n) if n > 0 else x

    def rand() -> np.ndarray:
        d = rng.standard_normal(x0.shape)
        if norm == "inf":
            return x0 + eps * rng.choice([-1.0, 1.0], size=x0.shape)
        return x0 + eps * d / np.linalg.norm(d)
    pts = [x0] + [rand() for _ in range(3)]
    for start in (x0, pts[-1]):
        x = torch.from_numpy(start.copy())
        for _ in range(6):
            x.requires_grad_(True)
            g, = torch.autograd.grad(f64(x).reshape(-1) @ ct, x, create_graph=True)
            val = g.abs().sum() if norm == "inf" else g.norm()
            h, = torch.autograd.grad(val, x)
            step = torch.sign(h) if norm == "inf" else h / (h.norm() + 1e-300)
            x = project(x.detach() + eps * step)
        pts.append(x.detach().numpy())
    return pts


@settings(max_examples=at_most(8), deadline=None)  # an example costs ~1.6 s on 2 shared cores
@given(kind=st.sampled_from(["mlp", "tf1", "researcher", "relu"]),
       eps=st.sampled_from([1e-3, 1e-2, 4e-2]), norm=st.sampled_from(["inf", "2"]),
       seed=st.integers(0, 2**16))
def test_adjoint_bound_never_below_the_exact_gradient_norm(kind: str, eps: float, norm: str,
                                                           seed: int) -> None:
    om, x0 = _models()[kind]
    rng = np.random.default_rng(seed)
    c = _weights(om, x0, rng)
    if norm == "2":
        eps *= 5  # the 2-ball of the same scale
    bound = AdjointGraph(om, x0, c).dual_norm_bound(eps, norm)
    assert bound is not None
    for x in _hunt(om, x0, c, eps, norm, rng):
        g = c @ _jac(om, x)
        exact = np.abs(g).sum() if norm == "inf" else np.linalg.norm(g)
        assert exact <= bound, (kind, eps, norm, exact, bound)


@pytest.mark.parametrize("kind", ["mlp", "tf1", "researcher", "relu"])
@pytest.mark.parametrize("norm", ["inf", "2"])
def test_adjoint_bound_tends_to_the_centre_gradient(models, kind: str, norm: str) -> None:
    """At a tiny ball the bound is the centre gradient's norm (a rule's factor dropped or
    doubled would show here, or below the exact norms above)."""
    om, x0 = models[kind]
    c = _weights(om, x0, np.random.default_rng(1))
    bound = AdjointGraph(om, x0, c).dual_norm_bound(1e-7, norm)
    g = c @ _jac(om, x0)
    exact = np.abs(g).sum() if norm == "inf" else np.linalg.norm(g)
    assert bound is not None
    assert exact <= bound <= exact * (1 + 1e-3)


def _form(rng: np.random.Generator, k: int, p: int, q: int) -> Aff:
    """A form over p input entries and q symbols whose entries mix signs over the ball."""
    c = rng.standard_normal(k)
    return Aff(c, np.abs(rng.standard_normal(k)) * 1e-3, 0.1 * rng.standard_normal(k),
               rng.standard_normal((k, p + q)), 0.05 * np.abs(rng.standard_normal(k)))


@settings(max_examples=at_most(25), deadline=None)  # an example costs ~100 ms on 2 shared cores
@given(seed=st.integers(0, 2**16), eps=st.sampled_from([0.05, 0.5, 2.0]))
def test_l1_and_l2_sups_enclose_every_realisation(seed: int, eps: float) -> None:
    """sum |g| and ||g|| at every corner of (d, e, the box, the centre's margin) stay within
    l1_sup and l2_sup. The l1 relaxation's cancellation is what it is for: at these sizes it is
    below the plain sum of the entries' extremes (0.5x of its mu fails this test)."""
    rng = np.random.default_rng(seed)
    k, p, q = 6, 5, 4
    f = _form(rng, k, p, q)
    ball = Ball(np.zeros(p), eps, "inf")
    b1, b2 = l1_sup(f, ball), l2_sup(f, Ball(np.zeros(p), eps, "2"))
    for _ in range(200):
        d = eps * rng.choice([-1.0, 1.0], size=p)
        e = rng.choice([-1.0, 1.0], size=q)
        g = f.c + f.m * rng.choice([-1.0, 1.0], size=k) + f.o + f.a @ np.concatenate([d, e]) \
            + f.b * rng.choice([-1.0, 1.0], size=k)
        assert np.abs(g).sum() <= b1
        d2 = rng.standard_normal(p)
        d2 *= eps / np.linalg.norm(d2)
        g2 = f.c + f.o + f.a @ np.concatenate([d2, e]) + f.b * rng.choice([-1.0, 1.0], size=k)
        assert np.linalg.norm(g2) <= b2


def test_certify_local_takes_the_adjoint_bound_where_smaller(models) -> None:
    """tf1's inf-ball at 3e-2: the enclosure gives 18x the lower bound, the tangent graph
    1.53x, the adjoint graph's rows 1.12x."""
    om, x0 = models["tf1"]
    res = certify_local(om, x0, 3e-2, "inf")
    k = _jac(om, x0).shape[0]
    rows = [AdjointGraph(om, x0, np.eye(k)[i]).dual_norm_bound(3e-2, "inf") for i in range(k)]
    assert None not in rows and res.upper is not None
    assert res.upper <= max(rows)  # type: ignore[type-var]
    assert "adjoint graph" in res.method
    exact = float(np.abs(_jac(om, x0)).sum(axis=1).max())
    assert exact <= res.upper <= 1.3 * exact


def test_robustness_mlp_inf_radius_is_at_least_0_6_of_the_attack(models) -> None:
    """Issue 15's target on the MLP's inf-ball: with the adjoint graph's margin constants
    the second sweep certifies 0.0714 of an attack at 0.117 (0.5995 before)."""
    om, x0 = models["mlp"]
    f64 = om.module.with_dtype(torch.float64)
    label = int(f64(torch.from_numpy(x0)).argmax())
    res = robustness(om, x0, label, "inf")
    assert res.attack_radius is not None
    assert res.certified_radius >= 0.6 * res.attack_radius
    assert res.certified_by == "sweep"


def test_sweep_constants_are_the_smaller_of_adjoint_and_enclosure(models, monkeypatch) -> None:
    om, x0 = models["tf1"]
    label = int(om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).argmax())
    both = sweep._constants_at(om, x0, 3e-2, "inf", label)
    monkeypatch.setattr(sweep, "ADJOINT_NORMS", ())
    enclosure = sweep._constants_at(om, x0, 3e-2, "inf", label)
    assert both is not None and enclosure is not None
    assert all(both[j] <= enclosure[j] for j in both)
    assert min(enclosure[j] / both[j] for j in both) > 3  # 18.9 vs 3.3 measured


def test_sweep_probe_walks_the_engines_of_the_next_piece(monkeypatch) -> None:
    """The sweep's probe of the affine radius walks the engines its next piece would (a copy
    of the sweep's turns): on the MLP's inf-ball the adjoint graph beat the
    enclosure at the centre, so the probe walks the adjoint graph alone, and the pieces walk
    the enclosure on the same schedule as without the probe (every ENCLOSURE_EVERY-th)."""
    om, x0 = _models()["mlp"]
    f = om.module.with_dtype(torch.float64)
    logits = f(torch.from_numpy(x0)).reshape(-1).detach()
    label = int(logits.argmax())
    margins = {j: float(logits[label] - logits[j]) - 1e-6 for j in range(logits.numel())
               if j != label}
    radii: list[float] = []
    real = sweep.local_jacobian

    def counted(om_, x_, r, *a, **k):  # type: ignore[no-untyped-def]
        radii.append(r)
        return real(om_, x_, r, *a, **k)
    monkeypatch.setattr(sweep, "local_jacobian", counted)
    free, runs_free, _ = sweep._sweep(om, x0, "inf", label, margins, 30)
    without = list(radii)
    radii.clear()
    floor = 1e-9  # below every piece: the probe does not end the sweep
    probed, runs_probed, _ = sweep._sweep(om, x0, "inf", label, margins, 30, floor=floor)
    assert (probed, runs_probed) == (free, runs_free + 1)
    # the enclosure at the centre and every ENCLOSURE_EVERY-th piece, not at the probe
    assert radii == without and sweep.SWEEP_PROBE * floor not in radii
    assert radii[0] == 0.0 and len(radii) == 1 + (runs_free - 1) // sweep.ENCLOSURE_EVERY


class SplitHeads(nn.Module):
    """GPT-2 / timm spellings: one qkv Linear split in three, a CLS token read by index
    (Gather), a slice of tokens (Slice), and a tanh-GELU head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, 8) -> (B, 3)
        q, k, v = self.qkv(x).split(8, dim=-1)  # (B, N, 8) each
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)  # (B, N, N)
        y = x + a @ v  # (B, N, 8)
        z = y[:, 0] + y[:, 1:3].mean(dim=1)  # CLS plus two tokens' mean, (B, 8)
        return self.head(nn.functional.gelu(z, approximate="tanh"))


@pytest.fixture(scope="module")
def split_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnnxModel, np.ndarray]:
    torch.manual_seed(0)
    m = SplitHeads().eval()
    path = tmp_path_factory.mktemp("split") / "split.onnx"
    torch.onnx.export(m, (torch.randn(1, 4, 8),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["logits"])
    x0 = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(2)).numpy()
    return load_onnx(path.read_bytes()), x0.astype(np.float64)


def test_adjoint_graph_through_split_gather_and_slice(split_model) -> None:
    """Split (several outputs), Gather of one index and Slice have adjoint rules: the graph is
    exact, and its bound holds at the hunted points of the inf-ball."""
    om, x0 = split_model
    ops = {n.op_type for n in om.module.runtime_nodes}  # type: ignore[union-attr]
    assert {"Split", "Gather", "Slice"} <= ops
    rng = np.random.default_rng(0)
    c = np.array([1.0, -1.0, 0.0])
    ag = AdjointGraph(om, x0, c)
    for _ in range(3):
        x = x0 + 0.3 * rng.standard_normal(x0.shape)
        np.testing.assert_allclose(ag.vjp(x).reshape(-1), c @ _jac(om, x), rtol=1e-9,
                                   atol=1e-12)
    bound = ag.dual_norm_bound(2e-2, "inf")
    assert bound is not None
    for x in _hunt(om, x0, c, 2e-2, "inf", rng):
        assert np.abs(c @ _jac(om, x)).sum() <= bound


def test_adjoint_cache_is_matched_by_the_model_itself(models, monkeypatch) -> None:
    """Two models whose cache keys collide (an address reused after the first is freed)
    never share graphs: the entry holds its model and is matched by identity."""
    monkeypatch.setattr(sweep, "_adj_key", lambda om, x, label: ("collide",))
    (tf1, x0), (mlp, _) = models["tf1"], models["mlp"]
    first = sweep._adjoint_graphs(tf1, x0, 0)
    second = sweep._adjoint_graphs(mlp, x0, 0)
    assert first and second
    assert all(g.model is tf1 for g in first.values())
    assert all(g.model is mlp for g in second.values())
    assert sweep._adjoint_graphs(mlp, x0, 0) is second  # cached for the same model


def test_adjoint_bound_is_none_where_the_forward_walk_stops(models, monkeypatch) -> None:
    """A forward walk that stops (an op without a rule, a form that overflowed) leaves the
    tensors after it without forms; the adjoint walk must then give no bound rather than read
    them as constants (which would drop their change over the ball)."""
    from lsa_models.engine.affine import walk as affine_rules
    om, x0 = models["tf1"]
    ag = AdjointGraph(om, x0, np.eye(4)[0])
    assert ag.dual_norm_bound(1e-2, "inf") is not None
    real = affine_rules.step

    def stop_at_softmax(node, *args, **kwargs):  # type: ignore[no-untyped-def]
        if node.op_type == "Softmax":
            raise affine_rules.NotAffine("stopped for the test")
        return real(node, *args, **kwargs)
    monkeypatch.setattr(affine_rules, "step", stop_at_softmax)
    assert ag.dual_norm_bound(1e-2, "inf") is None


@pytest.mark.parametrize("key", ["torch-mha-boolmask", "torch-mha-causal",
                                 "l2-broadcast-1head-causal", "torch-decoder-prenorm",
                                 "hf-llama", "sdpa-causal[", "sdpa-mask"])
def test_adjoint_and_tangent_graphs_through_attention_masks(key: str, tmp_path) -> None:
    """Masked attention from other libraries (a mask's -inf or float-minimum constant added
    to the scores, or put in by a Where with a constant condition): both graphs compute
    autodiff's products, and their inf-ball bounds hold at random corners of the ball (before:
    no rule for Where, and the walk stopped at the mask; SDPA's Split had no tangent, and its
    NaN guard Where(IsNaN(p), 0, p) an input-dependent condition)."""
    import warnings

    from lsa_models.engine.derived.tangent import TangentGraph
    from tests.zoo.cases import CASES
    from tests.zoo.harness import export as zoo_export
    warnings.simplefilter("ignore")
    case = next(c for c in CASES if c.key.startswith(key)
                and c.layout in ("(1, N, D)", "inputs_embeds"))
    built = case.build()
    path = zoo_export(built, case.exporters[0], tmp_path / "m.onnx")
    om = load_onnx(path.read_bytes(), path.name)
    x0 = built.example.numpy().astype(np.float64)
    rng = np.random.default_rng(0)
    jac0 = _jac(om, x0)
    c = rng.standard_normal(jac0.shape[0])
    ag, tg = AdjointGraph(om, x0, c), TangentGraph(om, x0)
    x = x0 + 0.1 * rng.standard_normal(x0.shape)
    s = rng.standard_normal(x0.shape)
    jx = _jac(om, x)
    np.testing.assert_allclose(ag.vjp(x).reshape(-1), c @ jx, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(tg.jvp(x, s).reshape(-1), jx @ s.reshape(-1), rtol=1e-9,
                               atol=1e-11)
    eps = 1e-2
    bound, rows = ag.dual_norm_bound(eps, "inf"), tg.bound(eps)
    assert bound is not None and rows is not None
    for _ in range(4):
        j = _jac(om, x0 + eps * rng.choice([-1.0, 1.0], size=x0.shape))
        assert np.abs(c @ j).sum() <= bound
        assert np.all(np.abs(j).sum(axis=1) <= rows)
