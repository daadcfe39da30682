"""The inf-ball constant from the tangent graph (lsa_models/engine/derived/tangent.py): the tangent
graph must compute J_F(X) s exactly (against autodiff), and its affine-form bound on every
row's l1 norm must never be below the exact float64 Jacobian's at points of the ball (random
corners, sign ascent on each row); the pair symbols' product rule must enclose every
realisation of its operands' forms."""

from __future__ import annotations

import functools
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.derived.tangent import NoTangent, TangentGraph
from lsa_models.engine.routes import constant as constant_routes
from lsa_models.engine.routes.certify import certify_local
from lsa_models.engine.values import Ball
from lsa_models.onnx import load_onnx
from lsa_models.onnx.loading import OnnxModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from local_models import build, center, export  # noqa: E402

from tests.profile import at_most

N, D = 4, 8


class Researcher(nn.Module):
    """The spellings researchers write by hand: RMSNorm (x / sqrt(mean x^2 + eps), a Div by
    an input-dependent tensor), nn.LayerNorm, softmax attention, erf GELU, SiLU (x *
    sigmoid(x)), an exp gate, a concatenation and a mean-pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.ff = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 3)
        h = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm
        h = self.ln(h)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / math.sqrt(D), dim=-1)
        y = h + a @ self.v(h)  # (B, N, D)
        g = torch.cat([nn.functional.gelu(y), y * torch.sigmoid(y)], dim=-1)  # (B, N, 2D)
        z = y + self.ff(g) * torch.exp(-0.5 * torch.tanh(y))
        return self.head(z.mean(dim=1))


def _seeded(cls: type[nn.Module], seed: int, path: Path) -> OnnxModel:
    """cls() built after torch.manual_seed(seed), exported (opset 17) and loaded."""
    torch.manual_seed(seed)
    m = cls().eval()
    torch.onnx.export(m, (torch.randn(1, N, D),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["logits"])
    return load_onnx(path.read_bytes())


def _researcher(seed: int, tmp: Path) -> OnnxModel:
    return _seeded(Researcher, seed, tmp / "researcher.onnx")


class TorchEncoder(nn.Module):
    """torch's own pre-norm encoder layer (ReLU FFN, fused attention) and a mean-pooled
    linear head: a model we did not write, and the ReLU every rule must take."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True,
                                              norm_first=True)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 3)
        return self.head(self.enc(x).mean(dim=1))


def _torch_encoder(seed: int, tmp: Path) -> OnnxModel:
    return _seeded(TorchEncoder, seed, tmp / "relu.onnx")


def _bench(kind: str, seed: int, tmp: Path) -> OnnxModel:
    return load_onnx(export(build(kind, seed), tmp / f"{kind}.onnx").read_bytes())


@functools.cache
def _models() -> dict[str, tuple[OnnxModel, np.ndarray]]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = {k: (_bench(k, 0, tmp), center(1).numpy().astype(np.float64))
               for k in ("mlp", "tf1")}
        g = torch.Generator().manual_seed(3)
        out["researcher"] = (_researcher(0, tmp),
                             torch.randn(1, N, D, generator=g).numpy().astype(np.float64))
        out["relu"] = (_torch_encoder(0, tmp),
                       torch.randn(1, N, D, generator=g).numpy().astype(np.float64))
    return out


@pytest.fixture
def models() -> dict[str, tuple[OnnxModel, np.ndarray]]:
    return _models()


def _jac(om: OnnxModel, x: np.ndarray) -> np.ndarray:
    f64 = om.module.with_dtype(torch.float64)
    j = torch.autograd.functional.jacobian(lambda t: f64(t).reshape(-1),
                                           torch.from_numpy(x))
    return j.reshape(j.shape[0], -1).numpy()  # (K, P)


@pytest.mark.parametrize("kind", ["mlp", "tf1", "researcher", "relu"])
def test_tangent_graph_computes_the_jacobian_vector_product(models, kind: str) -> None:
    om, x0 = models[kind]
    tg = TangentGraph(om, x0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = x0 + 0.3 * rng.standard_normal(x0.shape)
        s = rng.standard_normal(x0.shape)
        want = _jac(om, x) @ s.reshape(-1)
        got = tg.jvp(x, s).reshape(-1)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        if tg.deferred is not None:  # the final LayerNorm's tangent deferred past the head
            np.testing.assert_allclose(tg.jvp(x, s, deferred=True).reshape(-1), want,
                                       rtol=1e-9, atol=1e-12)
    assert (tg.deferred is not None) == (kind == "tf1")


def _hunt(om: OnnxModel, x0: np.ndarray, eps: float, rng: np.random.Generator
          ) -> list[np.ndarray]:
    """Points of the inf-ball where row norms of the exact Jacobian are large: random
    corners and, per output row, sign ascent on ||row||_1 (a few projected steps)."""
    pts = [x0] + [x0 + eps * rng.choice([-1.0, 1.0], size=x0.shape) for _ in range(4)]
    f64 = om.module.with_dtype(torch.float64)
    k = _jac(om, x0).shape[0]
    for i in range(k):
        x = torch.from_numpy(x0.copy())
        for _ in range(4):
            x.requires_grad_(True)
            j = torch.autograd.functional.jacobian(lambda t, i=i: f64(t).reshape(-1)[i], x,
                                                   create_graph=True)
            g, = torch.autograd.grad(j.abs().sum(), x)
            x = torch.clamp(x.detach() + eps * torch.sign(g),
                            torch.from_numpy(x0 - eps), torch.from_numpy(x0 + eps))
        pts.append(x.detach().numpy())
    return pts


@settings(max_examples=at_most(8), deadline=None)  # an example costs ~8.8 s on 2 shared cores
@given(kind=st.sampled_from(["mlp", "tf1", "researcher", "relu"]),
       eps=st.sampled_from([1e-3, 1e-2, 3e-2, 5e-2]), seed=st.integers(0, 2**16),
       quad=st.booleans())
def test_tangent_bound_never_below_the_exact_row_norms(kind: str, eps: float,
                                                       seed: int, quad: bool) -> None:
    """Also with the primal's second-order symbols (affine.QUAD) beside the pair symbols:
    the products then put the (d, d) part on the former and the (d, s) part on the latter."""
    om, x0 = _models()[kind]
    tg = TangentGraph(om, x0)
    rows = tg.bound(eps, quad=quad)
    assert rows is not None
    for x in _hunt(om, x0, eps, np.random.default_rng(seed)):
        exact = np.abs(_jac(om, x)).sum(axis=1)
        assert np.all(exact <= rows), (kind, eps, exact, rows)


@pytest.mark.parametrize("kind", ["mlp", "tf1", "researcher", "relu"])
def test_tangent_bound_tends_to_the_centre_jacobian(models, kind: str) -> None:
    """At a tiny ball the bound is the centre's row norms (a seed scaled by 2, a tangent
    rule's factor dropped or doubled would show here, or below the exact norms above)."""
    om, x0 = models[kind]
    rows = TangentGraph(om, x0).bound(1e-6)
    assert rows is not None
    exact = np.abs(_jac(om, x0)).sum(axis=1)
    assert np.all(rows >= exact)
    assert np.all(rows <= exact * (1 + 1e-3))


def test_tangent_bound_with_second_order_symbols_is_tighter_on_attention(models) -> None:
    """tf1's inf-ball at 5e-2: the primal's quadratic parts kept on the second-order
    symbols take the tangent bound from 11.0 to 7.5 (lower bound ~2.6); certify_local
    uses them wherever the graph has attention."""
    om, x0 = models["tf1"]
    tg = TangentGraph(om, x0)
    plain, quad = tg.bound(5e-2), tg.bound(5e-2, quad=True)
    assert plain is not None and quad is not None
    assert float(quad.max()) < 0.8 * float(plain.max())
    exact = float(np.abs(_jac(om, x0)).sum(axis=1).max())
    assert exact <= float(quad.max())


class _LeakyByMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x, 0.1 * x)  # ONNX Max: no tangent rule


def test_tangent_graph_names_an_op_without_a_rule(tmp_path: Path) -> None:
    m = nn.Sequential(nn.Flatten(1), nn.Linear(N * D, 8), _LeakyByMax(), nn.Linear(8, 2)).eval()
    path = tmp_path / "leaky.onnx"
    torch.onnx.export(m, (torch.randn(1, N, D),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["logits"])
    om = load_onnx(path.read_bytes())
    with pytest.raises(NoTangent, match="Max"):
        TangentGraph(om, np.zeros((1, N, D)))


def test_certify_local_takes_the_tangent_bound_where_smaller(models, monkeypatch) -> None:
    """tf1's inf-ball at 3e-2: the Jacobian enclosure's boxes compound (18x the lower bound),
    the tangent graph's forms give ~3.4x. (The tangent graph runs where the
    adjoint graph gave nothing: here it is switched off.)"""
    monkeypatch.setattr(constant_routes, "ADJOINT_MAX_ROWS", 0)
    om, x0 = models["tf1"]
    res = certify_local(om, x0, 3e-2, "inf")
    tan = TangentGraph(om, x0).bound(3e-2)
    assert tan is not None and res.upper is not None
    assert res.upper <= float(tan.max())
    assert "tangent graph" in res.method
    exact = float(np.abs(_jac(om, x0)).sum(axis=1).max())
    assert exact <= res.upper <= 5 * exact


def _concrete(f: Aff, z: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """A value the form allows: c + o + a z + b beta (the form's own symbols z)."""
    w = f.a.shape[-1]
    return f.c + f.o + (f.a * z[:w]).sum(axis=-1) + f.b * beta


@settings(deadline=None)
@given(seed=st.integers(0, 2**16), matmul=st.booleans(), eps=st.sampled_from([0.05, 0.5]))
def test_product_with_pair_symbols_encloses_every_realisation(seed: int, matmul: bool,
                                                              eps: float) -> None:
    """x (input part + other symbols) times y (direction part + input part + symbols) with the
    pair symbols psi_pq = d_p s_q / eps: for corners d, s and random symbol values, the exact
    product change lies in the output form evaluated at the same symbols, up to its box and
    its new symbols (any values). Dropping 70% of the pairs' coefficients fails this."""
    rng = np.random.default_rng(seed)
    p, q = 3, 2  # input size, other symbols
    base = 2 * p
    w = base + p * p + q
    shape_x, shape_y = ((2, 3), (3, 2)) if matmul else ((2, 3), (2, 3))

    def form(shape: tuple[int, ...], cols: slice) -> Aff:
        a = np.zeros((*shape, w))
        a[..., cols] = rng.standard_normal((*shape, cols.stop - cols.start))
        a[..., base + p * p:] = 0.1 * rng.standard_normal((*shape, q))
        return Aff(rng.standard_normal(shape), np.zeros(shape), 0.01 * rng.standard_normal(shape),
                   a, 0.01 * np.abs(rng.standard_normal(shape)))
    x = form(shape_x, slice(0, p))  # primal: the input's change
    y = form(shape_y, slice(0, 2 * p))  # tangent: input and direction
    ball = Ball(np.zeros(p), eps, "inf")
    tokens = (affine.PAIRS.set((p, base)), affine.SPACE.set([p, w - p, w - p]))
    try:
        out = affine_rules.product(x, y, ball, matmul)
    finally:
        affine.SPACE.reset(tokens[1])
        affine.PAIRS.reset(tokens[0])
    mul = np.matmul if matmul else np.multiply
    for _ in range(40):
        d = eps * rng.choice([-1.0, 1.0], size=p)
        s = rng.choice([-1.0, 1.0], size=p)
        e = rng.uniform(-1, 1, size=q)
        z = np.concatenate([d, s, (d[:, None] * s[None, :]).reshape(-1) / eps, e])
        bx, by = rng.uniform(-1, 1, shape_x), rng.uniform(-1, 1, shape_y)
        true = mul(_concrete(x, z, bx), _concrete(y, z, by)) - mul(x.c, y.c)
        zo = np.concatenate([z, np.zeros(out.a.shape[-1] - w)])
        known = out.o + (out.a[..., :w] * zo[:w]).sum(axis=-1)
        slack = out.b + np.abs(out.a[..., w:]).sum(axis=-1) + 1e-12
        assert np.all(np.abs(true - known) <= slack)
