"""The second-order signed rows of the inf-ball (lsa_models/engine/remainders/second_order.py,
docs/local-second-order.md "Second-order signed rows"): each elementwise op's split of its term into
a Hessian part and a rest, against the exact float64 term at corners and inside points of the
ball; and the output rows and margin constants of MLPs spelled with torch's own activations
against exact Jacobians at corners of the ball and at the projected-ascent witness."""

from __future__ import annotations

import copy
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.empirical.local import local_lower_bound
from lsa_models.engine.drivers.jacobian import local_jacobian
from lsa_models.engine.remainders import second_order as second_mod
from lsa_models.onnx import load_onnx
from lsa_models.onnx.loading import OnnxModel
from tests.profile import at_most

N, D = 4, 4


def _export(model: nn.Module) -> OnnxModel:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "m.onnx"
        torch.onnx.export(model.eval(), (torch.randn(1, N, D),), str(path), dynamo=False,
                          opset_version=18, input_names=["x"], output_names=["y"])
        return load_onnx(path.read_bytes())


class _MLP(nn.Module):
    """Flatten -> Linear -> act -> Linear -> act -> Linear, with torch's own activation
    modules (their ONNX spellings are torch's, not ours)."""

    def __init__(self, act: str, seed: int, width: int = 12) -> None:
        super().__init__()
        torch.manual_seed(seed)
        make = {"gelu_tanh": lambda: nn.GELU(approximate="tanh"), "tanh": nn.Tanh,
                "relu": nn.ReLU}[act]
        self.l1, self.l2, self.l3 = nn.Linear(N * D, width), nn.Linear(width, 8), \
            nn.Linear(8, 3)
        self.a1, self.a2 = make(), make()

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u1 = self.l1(x.reshape(1, -1))
        return u1, self.l2(self.a1(u1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.a2(self.pre(x)[1]))


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records every call of second_rows (the ops' adjoints and values) and runs it."""
    calls: list[Any] = []
    orig = second_mod.second_rows

    def spy(st: Any, terms: list, zr: np.ndarray, jcm: np.ndarray, jrr: np.ndarray,
            eps: float) -> Any:
        calls.append((terms, eps))
        return orig(st, terms, zr, jcm, jrr, eps)

    monkeypatch.setattr(second_mod, "second_rows", spy)
    return calls


def _slope(act: str, u: torch.Tensor) -> torch.Tensor:
    ut = u.detach().clone().requires_grad_(True)
    f = {"gelu_tanh": lambda z: nn.functional.gelu(z, approximate="tanh"), "tanh": torch.tanh,
         "relu": torch.relu}[act]
    (g,) = torch.autograd.grad(f(ut).sum(), ut)
    return g


def _rule_of(om: OnnxModel, x0: np.ndarray, eps: float, y0: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs the engine on the inf-ball and returns (H, r, g as (M, n)) of the op whose output
    centre is y0 (exactly one must match), from the output rows' second-order pass."""
    with pytest.MonkeyPatch.context() as mp:
        calls = _capture(mp)
        local_jacobian(om, x0, eps, "inf")
    assert calls, "the second-order rows were not run"
    terms, _ = calls[-1]
    hits = [(g, ga, u) for g, ga, u, _ in terms if u.remainder is not None
            and u.remainder.second is not None and u.center.size == y0.size
            and np.allclose(u.center.reshape(-1), y0, rtol=1e-6, atol=1e-9)]
    assert len(hits) == 1
    g, ga, u = hits[0]
    got = u.remainder.second(g, ga, eps)
    _LAST_RULE[:] = [got]
    hess, rest = got
    return hess, rest, g.reshape(g.shape[0], -1)


_LAST_RULE: list[Any] = []  # the last rule's full answer (second.Factored where it is one)


def _signed_sums_hold(rng: np.random.Generator, got: Any, rho: np.ndarray) -> None:
    """For the exact residual rho = T(X) - H . d (M, P) and sign rows s (rho's own, random,
    random with zeros): sum_p s_ip rho_ip <= sum_facs sum_b c_ib |sum_p s_ip jc_bp| +
    sum_p |s_ip| other_ip (second.Factored, what second_rows uses on sign-fixed entries)."""
    from lsa_models.engine.remainders.second_order import Factored
    assert isinstance(got, Factored)
    for s in (np.sign(rho), np.sign(rng.standard_normal(rho.shape)),
              rng.choice([-1.0, 0.0, 1.0], size=rho.shape)):
        lhs = (s * rho).sum(axis=1)
        rhs = sum((c * np.abs(s @ jc.T)).sum(axis=1) for c, jc in got.facs) + \
            (np.abs(s) * got.other).sum(axis=1)
        assert np.all(lhs <= rhs * (1 + 1e-9) + 1e-15), float(np.max(lhs - rhs))


def _factored_holds(rng: np.random.Generator, x0: np.ndarray, eps: float, got: Any,
                    term_at: Any) -> None:
    """The factored rest (second.Factored): for the exact residual rho = T(X) - H . d and
    sign rows s (rho's own, random, random with zeros), sum_p s_ip rho_ip <= sum_b c_ib
    |sum_p s_ip jc_bp| + sum_p |s_ip| other_ip, at 3 corners and 3 inside points."""
    hess, _ = got
    for t in range(6):
        e = _corner_or_inside(rng, x0.shape, t)
        rho = term_at(torch.from_numpy(x0 + eps * e)) - hess @ (eps * e).reshape(-1)
        _signed_sums_hold(rng, got, rho)


def _walk_at(om: OnnxModel, seed: int, eps: float) -> tuple[np.random.Generator, np.ndarray,
                                                             dict]:
    """(rng, X0, the enclosure's values on the inf-ball of radius eps) for a seeded centre."""
    from lsa_models.engine.drivers.jacobian_walk import walk
    from lsa_models.engine.values import Ball
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    module = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x0))
    values, _ = walk(om, module, env, Ball(x0, eps, "inf"), None)
    return rng, x0, values


def _corner_or_inside(rng: np.random.Generator, shape: tuple[int, ...], t: int) -> np.ndarray:
    """A corner of the unit box for even t, a point inside it for odd t."""
    return rng.choice([-1.0, 1.0], size=shape) if t % 2 == 0 else rng.uniform(-1.0, 1.0, size=shape)


def _act_term(model: nn.Module, act: str, k: int, gs: np.ndarray, s0: torch.Tensor,
              x: np.ndarray) -> np.ndarray:
    """The k-th activation's term at X, g (f'(u_k(X)) - f'(u_k(X0))) J_u_k(X), exact (M, P)."""
    xt = torch.from_numpy(x)
    ju = torch.autograd.functional.jacobian(lambda z: model.pre(z)[k].reshape(-1),
                                            xt).reshape(-1, x.size)
    ds = (_slope(act, model.pre(xt)[k]) - s0).reshape(-1)
    return (gs * ds.numpy()) @ ju.numpy()


def _holds_at_points(rng: np.random.Generator, x0: np.ndarray, eps: float, hess: np.ndarray,
                     rest: np.ndarray, term_at: Any) -> None:
    """|T(X) - H . d| <= r at 3 corners and 3 inside points; term_at(X) -> T(X) (M, P)."""
    for t in range(6):
        e = rng.choice([-1.0, 1.0], size=x0.shape) if t % 2 == 0 else \
            rng.uniform(-1.0, 1.0, size=x0.shape)
        term = term_at(torch.from_numpy(x0 + eps * e))
        lin = hess @ (eps * e).reshape(-1)
        assert np.all(np.abs(term - lin) <= rest), float(np.max(np.abs(term - lin) - rest))


@settings(max_examples=at_most(12), deadline=None)  # an example costs ~930 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.05, 0.2]),
       act=st.sampled_from(["gelu_tanh", "tanh", "relu"]))
def test_second_rule_bounds_each_term_at_points_of_the_ball(seed: int, eps: float,
                                                           act: str) -> None:
    """For each elementwise op with adjoint g: |T(X) - H . d| <= r entrywise, T(X) =
    g (f'(u(X)) - f'(u(X0))) J_u(X) computed exactly in float64 at corners and inside."""
    model = _MLP(act, seed % 97).double()
    om = _export(_MLP(act, seed % 97))
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    with pytest.MonkeyPatch.context() as mp:
        calls = _capture(mp)
        local_jacobian(om, x0, eps, "inf")
    assert calls, "the second-order rows were not run"
    terms, _ = calls[-1]
    c = torch.from_numpy(x0)
    # the ops are recognised by their outputs' centres: a1(u1) and a2(u2)
    y0 = [a(u).detach().numpy().reshape(-1) for a, u in zip((model.a1, model.a2),
                                                             model.pre(c), strict=True)]
    checked = 0
    for g, ga, u, _bound in terms:
        if u.remainder is None or u.remainder.second is None:
            continue
        # a1's output has 12 entries, a2's 8 (the centres agree to the export's float32)
        which = [k for k in range(2) if y0[k].shape == u.center.reshape(-1).shape
                 and np.allclose(y0[k], u.center.reshape(-1), rtol=1e-4, atol=1e-6)]
        assert len(which) == 1
        k = which[0]
        got = u.remainder.second(g, ga, eps)
        hess, rest = got
        s0 = _slope(act, model.pre(c)[k])
        gs = g.reshape(g.shape[0], -1)
        for t in range(6):
            e = _corner_or_inside(rng, x0.shape, t)
            term = _act_term(model, act, k, gs, s0, x0 + eps * e)  # (M, P)
            lin = hess @ (eps * e).reshape(-1)  # (M, P)
            assert np.all(np.abs(term - lin) <= rest), float(np.max(np.abs(term - lin) - rest))
            _signed_sums_hold(rng, got, term - lin)  # the factored rest (second.Factored)
        checked += 1
    assert checked == 2


@pytest.fixture(scope="module", params=["gelu_tanh", "tanh", "relu"])
def mlp(request: pytest.FixtureRequest) -> tuple[nn.Module, OnnxModel]:
    return _MLP(request.param, 3, width=16).double(), _export(_MLP(request.param, 3, width=16))


@settings(max_examples=at_most(6), deadline=None)  # an example costs ~2.2 s on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.05, 0.2, 0.5]))
def test_second_rows_hold_on_torch_mlps(mlp: tuple[nn.Module, OnnxModel], seed: int,
                                        eps: float) -> None:
    """rows_abs and the margin constants against exact Jacobians at corners of the inf-ball
    and at the projected-ascent witness."""
    model, om = mlp
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    lj = local_jacobian(om, x0, eps, "inf", margins_of=0)
    assert lj.structured is not None and lj.structured.rows_abs is not None
    pts = [x0 + rng.choice([-1.0, 1.0], size=x0.shape) * eps for _ in range(6)]
    pts.append(local_lower_bound(model, x0, eps, "inf", restarts=2, steps=10,
                                 seed=seed).witness)
    rows = np.abs(lj.jc).sum(axis=1) + lj.structured.rows_inf  # the factored terms' rows
    for x in pts:
        jac = torch.autograd.functional.jacobian(
            lambda z: model(z).reshape(-1), torch.from_numpy(x)).reshape(3, -1).numpy()
        assert np.all(np.abs(jac).sum(axis=1) <= lj.structured.rows_abs)
        assert np.all(np.abs(jac).sum(axis=1) <= rows)
        for j, bound in lj.margin_dual.items():
            assert float(np.abs(jac[0] - jac[j]).sum()) <= bound


@settings(max_examples=at_most(8), deadline=None)  # an example costs ~660 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.05, 0.2]),
       act=st.sampled_from(["gelu_tanh", "tanh", "relu"]))
def test_value_radius_bounds_the_checkpoint_values(seed: int, eps: float, act: str) -> None:
    """second.value_radius at the second activation's input u2 (a checkpoint): |u2(X) -
    u2(X0)| <= rad and |u2(X) - u2(X0) - jc . d| <= nonlin (+ the centre's margin) at
    corners, inside points and the corners that follow each entry's centre gradient; at
    eps 1e-3 those corners reach 0.9 rad (the eps^2 and rest parts are small there), so a
    radius off by a factor would be caught."""
    model = _MLP(act, seed % 97).double()
    om = _export(_MLP(act, seed % 97))
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    got: list[tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]] = []
    orig = second_mod.value_radius

    def spy(hess: np.ndarray, rest: np.ndarray, jc: np.ndarray, e: float
            ) -> tuple[np.ndarray, np.ndarray]:
        out = orig(hess, rest, jc, e)
        got.append((jc.reshape(rest.shape), out))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(second_mod, "value_radius", spy)
        local_jacobian(om, x0, eps, "inf")
    c = torch.from_numpy(x0)
    u20 = model.pre(c)[1].detach().numpy().reshape(-1)
    ju = torch.autograd.functional.jacobian(lambda z: model.pre(z)[1].reshape(-1),
                                            c).reshape(-1, x0.size).numpy()
    hits = [(jc, out) for jc, out in got if jc.shape == ju.shape
            and np.allclose(jc, ju, atol=1e-9)]
    assert hits, "no value radius at u2"
    jc, (rad0, nonlin) = hits[-1]
    slack = 1e-12 * (1 + np.abs(u20))  # the centre's forward margin (float64)
    rad = rad0 + slack
    pts = [rng.choice([-1.0, 1.0], size=x0.shape) for _ in range(3)] + \
        [rng.uniform(-1.0, 1.0, size=x0.shape) for _ in range(3)] + \
        [s * np.sign(ju[i]).reshape(x0.shape) for i in range(ju.shape[0]) for s in (1, -1)]
    reach = np.zeros_like(u20)
    for e in pts:
        dv = model.pre(torch.from_numpy(x0 + eps * e))[1].detach().numpy().reshape(-1) - u20
        du = np.abs(dv)
        assert np.all(du <= rad), float(np.max(du - rad))
        lin = jc @ (eps * e).reshape(-1)
        assert np.all(np.abs(dv - lin) <= nonlin + slack + 1e-13 * np.abs(jc).sum(axis=1) * eps)
        reach = np.maximum(reach, du)
    if eps == 1e-3 and act != "relu":
        assert np.all(reach >= 0.9 * rad0)


def test_second_rows_tighten_the_gelu_mlp_at_small_eps() -> None:
    """On the issue-15 MLP at eps = 1e-2 the Hessian form beats the first-order signed rows:
    the bound comes within 1.1x of the centre's norm (it was 1.41x without it)."""
    from bench.local_models import build, center, export
    with tempfile.TemporaryDirectory() as tmp:
        om = load_onnx(export(build("mlp", seed=0), Path(tmp) / "mlp.onnx").read_bytes())
    lj = local_jacobian(om, center(1).numpy().astype(np.float64), 1e-2, "inf")
    assert lj.upper() <= 1.25 * lj.center_norm()


class _RowNet(nn.Module):
    """tanh(x W) per token, then torch's nn.LayerNorm or a softmax over the last axis, then a
    head on the flattened tokens: the row op's input Jacobian moves over the ball."""

    def __init__(self, kind: str, seed: int, scale: float) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        self.lin, self.ln, self.head = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(N * D, 3)
        with torch.no_grad():
            self.lin.weight.mul_(scale)
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.normal_()

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * (3.0 if self.kind == "softmax" else 1.0)  # (1, N, D)

    def op(self, u: torch.Tensor) -> torch.Tensor:
        return self.ln(u) if self.kind == "layernorm" else torch.softmax(u, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.op(self.pre(x)).reshape(1, -1))


@settings(max_examples=at_most(10), deadline=None)  # an example costs ~510 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.05, 0.2]),
       scale=st.sampled_from([0.3, 1.0, 3.0]), kind=st.sampled_from(["layernorm", "softmax"]))
def test_second_rule_bounds_the_row_op_term_at_points_of_the_ball(
        seed: int, eps: float, scale: float, kind: str) -> None:
    """The LayerNorm rule (signed_adjoints.layernorm_rules' `second`) and the softmax rule
    (second.softmax_second): |T(X) - H . d| <= r with T(X) = g (D_op(x(X)) - D_op(x(X0)))
    J_x(X), exact in float64, at corners and inside points."""
    model = _RowNet(kind, seed % 89, scale).double()
    om = _export(_RowNet(kind, seed % 89, scale))
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    c = torch.from_numpy(x0)
    y0 = model.op(model.pre(c)).detach().numpy().reshape(-1)
    hess, rest, gs = _rule_of(om, x0, eps, y0)

    def d_op(x: torch.Tensor) -> np.ndarray:
        return torch.autograd.functional.jacobian(
            lambda z: model.op(z).reshape(-1), model.pre(x).detach()).reshape(
                x0.size, x0.size).numpy()

    d0 = d_op(c)

    def term_at(x: torch.Tensor) -> np.ndarray:
        jx = torch.autograd.functional.jacobian(lambda z: model.pre(z).reshape(-1),
                                                x).reshape(-1, x0.size).numpy()
        return gs @ (d_op(x) - d0) @ jx  # (M, P)

    _holds_at_points(rng, x0, eps, hess, rest, term_at)
    _factored_holds(rng, x0, eps, _LAST_RULE[0], term_at)


class _Bilinear(nn.Module):
    """tanh(x Wa) @ tanh(x Wb)^T (a MatMul of two input-dependent tensors, as attention's
    q k^T), then a head on the flattened (N, N) scores."""

    def __init__(self, seed: int, scale: float) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.qa, self.kb, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(N * N, 3)
        with torch.no_grad():
            self.qa.weight.mul_(scale)
            self.kb.weight.mul_(scale)

    def ops(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.qa(x)), torch.tanh(self.kb(x)).transpose(-1, -2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.ops(x)
        return self.head((a @ b).reshape(1, -1))


@settings(max_examples=at_most(10), deadline=None)  # an example costs ~450 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.05, 0.2]),
       scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_second_rule_bounds_the_matmul_term_at_points_of_the_ball(
        seed: int, eps: float, scale: float) -> None:
    """The MatMul rule (second.matmul_second): |T(X) - H . d| <= r with T(X) = g (J_y(X) -
    (J_A(X) B0 + A0 J_B(X))), exact in float64, at corners and inside points."""
    model = _Bilinear(seed % 83, scale).double()
    om = _export(_Bilinear(seed % 83, scale))
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    a0, b0 = (t.detach() for t in model.ops(torch.from_numpy(x0)))
    hess, rest, gs = _rule_of(om, x0, eps, (a0 @ b0).numpy().reshape(-1))

    def jac(f: Any, x: torch.Tensor) -> np.ndarray:
        return torch.autograd.functional.jacobian(lambda z: f(z).reshape(-1), x).reshape(
            -1, x0.size).numpy()

    def prod(z: torch.Tensor) -> torch.Tensor:
        a, b = model.ops(z)
        return a @ b

    def frozen(z: torch.Tensor) -> torch.Tensor:  # D(X0) applied to the operands' moves
        a, b = model.ops(z)
        return a @ b0 + a0 @ b

    _holds_at_points(rng, x0, eps, hess, rest, lambda x: gs @ (jac(prod, x) - jac(frozen, x)))


class _Gate(nn.Module):
    """tanh(x Wa) * sigmoid(x Wb) entrywise, or broadcast against one gate per token
    (N, 1) as RMSNorm's x * rsqrt(mean(x^2)) is, then a head on the flattened product."""

    def __init__(self, seed: int, scale: float, per_token: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.qa, self.kb = nn.Linear(D, D), nn.Linear(D, 1 if per_token else D)
        self.head = nn.Linear(N * D, 3)
        with torch.no_grad():
            self.qa.weight.mul_(scale)
            self.kb.weight.mul_(scale)

    def ops(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.qa(x)), torch.sigmoid(self.kb(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.ops(x)
        return self.head((a * b).reshape(1, -1))


@settings(max_examples=at_most(10), deadline=None)  # an example costs ~460 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.05, 0.2]),
       scale=st.sampled_from([0.3, 1.0, 3.0]), per_token=st.booleans())
def test_second_rule_bounds_the_mul_term_at_points_of_the_ball(
        seed: int, eps: float, scale: float, per_token: bool) -> None:
    """The elementwise product rule (second.mul_second), broadcast or not: |T(X) - H . d|
    <= r with T(X) = g (J_y(X) - (J_A(X) B0 + A0 J_B(X))), exact in float64, at corners and
    inside points."""
    model = _Gate(seed % 79, scale, per_token).double()
    om = _export(_Gate(seed % 79, scale, per_token))
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    a0, b0 = (t.detach() for t in model.ops(torch.from_numpy(x0)))
    hess, rest, gs = _rule_of(om, x0, eps, (a0 * b0).numpy().reshape(-1))

    def jac(f: Any, x: torch.Tensor) -> np.ndarray:
        return torch.autograd.functional.jacobian(lambda z: f(z).reshape(-1), x).reshape(
            -1, x0.size).numpy()

    def prod(z: torch.Tensor) -> torch.Tensor:
        a, b = model.ops(z)
        return a * b

    def frozen(z: torch.Tensor) -> torch.Tensor:  # D(X0) applied to the operands' moves
        a, b = model.ops(z)
        return a * b0 + a0 * b

    _holds_at_points(rng, x0, eps, hess, rest, lambda x: gs @ (jac(prod, x) - jac(frozen, x)))


@pytest.mark.parametrize("act", ["gelu_tanh", "tanh"])
@pytest.mark.parametrize("eps", [0.05, 0.2, 0.5])
def test_second_rule_holds_where_one_neuron_moves_most(act: str, eps: float) -> None:
    """One hidden neuron: the first activation's rest is |g| e |jc| alone (its input is
    linear), and the corners d = +-eps sign(w) move that neuron by its whole range, where
    the curvature part e (the nested-interval integral) is nearly reached."""
    model = _MLP(act, 5, width=1).double()
    om = _export(_MLP(act, 5, width=1))
    x0 = np.random.default_rng(7).standard_normal((1, N, D)) * 0.3
    c = torch.from_numpy(x0)
    u1 = model.pre(c)[0]
    hess, rest, gs = _rule_of(om, x0, eps, model.a1(u1).detach().numpy().reshape(-1))
    w = model.l1.weight.detach().numpy().reshape(-1)  # (P,): u1 = w . x + b
    s0 = _slope(act, u1)
    for sign in (-1.0, 1.0):
        d = sign * eps * np.sign(w).reshape(x0.shape)
        x = torch.from_numpy(x0 + d)
        ds = float((_slope(act, model.pre(x)[0]) - s0).reshape(-1)[0])
        term = gs * ds @ w[None, :]  # (M, P): g dD J_u
        gap = np.abs(term - hess @ d.reshape(-1))
        assert np.all(gap <= rest), float((gap / rest).max())


def test_telescope_terms_memo_is_keyed_by_the_value_objects() -> None:
    """The telescoped terms are computed once per (tensor, value objects, combos): asked
    again with the same values they are reused, and a value replaced by another object (a
    tightened tensor, or the same tensor walked on another ball) recomputes them."""
    from dataclasses import replace

    from lsa_models.engine.drivers.jacobian_walk import walk
    from lsa_models.engine.remainders.telescope import Telescope
    from lsa_models.engine.values import Ball, LocalValue
    om = _export(_MLP("tanh", 2))
    x0 = np.random.default_rng(2).standard_normal((1, N, D))
    module = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x0))
    zero, _ = walk(om, module, env, Ball(x0, 0.0, "inf"), None)
    tight = Telescope(om, x0, zero)
    values, _ = walk(om, module, env, Ball(x0, 0.05, "inf"), None)
    out = om.spec.output_name
    first = tight._terms(out, values, None)
    assert first is not None and tight._terms(out, values, None) is first
    other, _ = walk(om, module, env, Ball(x0, 0.1, "inf"), None)  # another ball
    again = tight._terms(out, other, None)
    assert again is not first and again is not None
    name = next(t for t, u in values.items() if getattr(u, "term", None) is not None)
    swapped = dict(values)
    v = values[name]
    assert isinstance(v, LocalValue)
    swapped[name] = replace(v)  # equal fields, another object
    assert tight._terms(out, swapped, None) is not first


@settings(max_examples=at_most(12), deadline=None)  # an example costs ~300 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-2, 0.05, 0.2, 0.5]),
       act=st.sampled_from(["gelu_tanh", "tanh"]))
def test_factored_jacobian_deviation_holds_on_the_second_layer(seed: int, eps: float,
                                                               act: str) -> None:
    """LocalValue.jfac of the second activation's input u2 = W2 f(u1) (set by the first
    activation, carried through the Linear): J(X) - jc = M diag(delta) src + R with
    |delta| <= dmb, |R| <= rest, checked through what second.py uses it for: for weights w
    over u2's entries and signs s over the input, sum_bp w_b s_p (J(X) - jc)_bp <=
    sum_c |sum_b w_b M_bc| dmb_c |sum_p s_p src_cp| + sum_bp |w_b| |s_p| rest_bp, with s the
    signs of the left side's own terms, at corners and inside points."""
    from lsa_models.engine.drivers import jacobian as driver
    model = _MLP(act, seed % 97).double()
    om = _export(_MLP(act, seed % 97))
    rng, x0, values = _walk_at(om, seed, eps)
    u2c = model.pre(torch.from_numpy(x0))[1].detach().numpy().reshape(-1)
    hits = [v for v in values.values() if isinstance(v, driver.LocalValue)
            and v.jfac is not None and v.center.size == u2c.size
            and np.allclose(v.center.reshape(-1), u2c, rtol=1e-5, atol=1e-7)]
    assert hits, "the second activation's input carries no factored deviation"
    v = hits[0]
    m, dmb, src, rest = v.jfac
    b = u2c.size
    m, rest = m.reshape(b, -1), rest.reshape(b, -1)
    jc = v.jc.reshape(b, -1)
    for t in range(6):
        e = rng.choice([-1.0, 1.0], size=x0.shape) if t % 2 == 0 else \
            rng.uniform(-1.0, 1.0, size=x0.shape)
        x = torch.from_numpy(x0 + eps * e)
        jx = torch.autograd.functional.jacobian(lambda z: model.pre(z)[1].reshape(-1),
                                                x).reshape(b, -1).numpy()
        dev = jx - jc
        for w in (rng.standard_normal(b), np.eye(b)[rng.integers(b)]):
            s = np.sign(w @ dev)
            lhs = float(w @ dev @ s)
            rhs = float((np.abs(w @ m) * dmb * np.abs(src @ s)).sum()
                        + np.abs(w) @ rest @ np.abs(s))
            assert lhs <= rhs * (1 + 1e-9) + 1e-15, (lhs, rhs)


@settings(max_examples=at_most(16), deadline=None)  # an example costs ~410 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-2, 0.05, 0.2, 0.5]),
       act=st.sampled_from(["gelu_tanh", "tanh"]), saturated=st.booleans())
def test_elementwise_parts_alternatives_each_bound_the_term(seed: int, eps: float,
                                                           act: str, saturated: bool) -> None:
    """The second activation's parts (structured.PartsChoice: the entrywise decomposition
    and the one through its input's factored deviation, LocalValue.jfac), each on its own:
    sum_p |T_ip(X)| <= the structured rows bound, T(X) = g (f'(u2(X)) - f'(u2(X0))) J_u2(X)
    exact in float64, at corners, inside points and the corners of the rows' own signs."""
    from lsa_models.engine.drivers import jacobian as driver
    from lsa_models.engine.remainders.structured_norms import PartsChoice, _factored
    m32 = _MLP(act, seed % 97)
    if saturated:  # the first activation's slope near 0 at X0, large on the ball: the
        with torch.no_grad():  # second layer's jc is small and its J(X) moves (the jfac part)
            m32.l1.bias.fill_(3.0 if act == "tanh" else -4.0)
    om = _export(m32)
    model = copy.deepcopy(m32).double()
    rng, x0, values = _walk_at(om, seed, eps)
    c0 = torch.from_numpy(x0)
    y2c = model.a2(model.pre(c0)[1]).detach().numpy().reshape(-1)
    hits = [v for v in values.values() if isinstance(v, driver.LocalValue)
            and v.parts is not None and v.center.size == y2c.size
            and np.allclose(v.center.reshape(-1), y2c, rtol=1e-5, atol=1e-7)]
    assert hits
    y2 = hits[0]
    g = rng.standard_normal((3, y2c.size))
    parts = y2.parts(np.abs(g))
    assert isinstance(parts, PartsChoice) and len(parts) == 2
    bounds = [_factored([alt], 3, x0.size)[0] for alt in parts]
    s0 = _slope(act, model.pre(c0)[1]).reshape(-1)

    def rows_at(e: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(x0 + eps * e)
        ju = torch.autograd.functional.jacobian(lambda z: model.pre(z)[1].reshape(-1),
                                                x).reshape(-1, x0.size).numpy()
        ds = (_slope(act, model.pre(x)[1]).reshape(-1) - s0).numpy()
        return np.abs((g * ds) @ ju).sum(axis=1)

    pts = [rng.choice([-1.0, 1.0], size=x0.shape) for _ in range(4)]
    pts += [rng.uniform(-1.0, 1.0, size=x0.shape) for _ in range(2)]
    jc = y2.jc.reshape(y2c.size, -1)
    pts += [np.sign(g[i] @ jc).reshape(x0.shape) for i in range(3)]
    for e in pts:
        r = rows_at(e)
        for b in bounds:
            assert np.all(r <= b * (1 + 1e-9)), (r, b)


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.1, 1.0]))
def test_unfixed_signs_bound_every_corner(seed: int, eps: float) -> None:
    """second._unfixed_signs: for J_ip(X) = jc_ip + H_i[p] . d + rho_ip with |rho| <= r, the
    row sums sum_p |J_ip| at every corner d of the inf-ball (P = 6: all 64) and the worst rho
    stay below the bound (the fixed entries: eps ||H_i[p]||_1 + r_ip < |jc_ip|)."""
    from lsa_models.engine.remainders.second_order import _unfixed_signs
    rng = np.random.default_rng(seed)
    m, p = 3, 6
    hess = rng.standard_normal((m, p, p)) * rng.choice([0.1, 1.0, 10.0])
    jc = rng.standard_normal((m, p))
    rest = np.abs(rng.standard_normal((m, p))) * eps * eps
    ah = np.abs(hess)
    h = eps * ah.sum(axis=2) + rest
    fixed = h < np.abs(jc)
    s = np.where(fixed, np.sign(jc), 0.0)
    lin = (s[:, None, :] @ hess)[:, 0]
    lin_err = 1e-15 * (np.abs(s)[:, None, :] @ ah)[:, 0]
    rest_f = np.where(fixed, rest, 0.0).sum(axis=1)
    bound = _unfixed_signs(hess, ah, lin, lin_err, np.abs(jc), rest, fixed, rest_f, eps)
    corners = eps * np.array(np.meshgrid(*[[-1.0, 1.0]] * p)).reshape(p, -1).T  # (64, P)
    for d in corners:
        core = jc + hess @ d  # (M, P)
        rows = (np.abs(core) + rest).sum(axis=1)  # the worst rho: |rho| = r, signs aligned
        assert np.all(rows <= bound * (1 + 1e-12)), (rows, bound)


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.1, 0.5]))
def test_signed_c2_bounds_the_ops_change_mixed_by_the_jfac_map(seed: int, eps: float) -> None:
    """second._signed_c2 with delta = 1 bounds |sum_c G_ic fm_cb (f'(u_c(X)) - f'(u_c(X0)))|
    for y = tanh(u), u = A x linear (jc = A exactly, eps_c = 0), m = f''(u0) and
    e_c = sup|f'''| du_c^2 / 2, at the corners that extremise each (i, b)'s linear part and at
    random corners: the first-order part is kept signed over c, so at small eps the bound is
    nearly attained (a 0.3x first-order part fails there)."""
    from lsa_models.engine.remainders.second_order import _signed_c2
    rng = np.random.default_rng(seed)
    k, b, bs, p = 2, 6, 5, 7
    a = rng.standard_normal((b, p))
    u0 = rng.standard_normal(b)
    g = rng.standard_normal((k, b))
    fm = rng.standard_normal((b, bs))
    t0 = np.tanh(u0)
    m = -2.0 * t0 * (1.0 - t0 ** 2)  # tanh''
    du = eps * np.abs(a).sum(axis=1)
    e = 0.5 * 2.0 * du ** 2  # |tanh'''| <= 2
    c = np.abs(g) * e
    bound = _signed_c2(g, fm, m, a, np.abs(a), c, np.ones(bs), eps)  # (k, Bs)
    assert np.all(np.isfinite(bound))

    def change(d: np.ndarray) -> np.ndarray:  # (k, Bs) exact
        dd = (1.0 - np.tanh(u0 + a @ d) ** 2) - (1.0 - t0 ** 2)
        return (g * dd) @ fm

    lin = np.einsum("kc,cb,cp->kbp", g * m, fm, a)
    pts = [eps * np.sign(lin[i, j]) for i in range(k) for j in range(bs)]
    pts += [eps * rng.choice([-1.0, 1.0], size=p) for _ in range(4)]
    worst = 0.0
    for d in pts:
        got = np.abs(change(d))
        assert np.all(got <= bound * (1 + 1e-12)), float(np.max(got - bound))
        worst = max(worst, float(np.max(got / bound)))
    if eps <= 1e-2:  # the first-order part dominates: the bound is nearly attained
        assert worst > 0.3


@settings(max_examples=at_most(6), deadline=None)  # an example costs ~1.8 s on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([0.1, 0.3]))
def test_unfixed_factored_bounds_the_unfixed_entries_changes(seed: int, eps: float) -> None:
    """second._unfixed_factored: sum over the entries U of unfixed sign of |J_ip(X) - jc_ip|
    <= its bound per row, J exact in float64, at random corners and after projected ascent on
    that sum; the ascent reaches more than 0.1 of the bound on some row (0.22 measured:
    per entry the worst d differs, and the bound takes each entry's own)."""
    from lsa_models.engine.remainders.second_order import (
        _unfixed_factored,
        entry_bounds,
        hessian_rest_factored,
        hessian_rows,
    )
    model = _MLP("gelu_tanh", seed % 97).double()
    om = _export(_MLP("gelu_tanh", seed % 97))
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    seen: list[Any] = []
    orig = second_mod.second_rows

    def spy(st_: Any, terms: list, zr: np.ndarray, jcm: np.ndarray, jrr: np.ndarray,
            e: float) -> Any:
        seen.append((terms, zr, jcm, jrr))
        return orig(st_, terms, zr, jcm, jrr, e)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(second_mod, "second_rows", spy)
        local_jacobian(om, x0, eps, "inf")
    terms, zr, jcm, jrr = seen[-1]
    hess, rest, facs, other = hessian_rest_factored(terms, zr, eps)
    ah = np.abs(hess)
    fixed = np.minimum(entry_bounds(hessian_rows(ah), rest, eps), jrr) < np.abs(jcm)
    bound = _unfixed_factored(hess, hessian_rows(ah), facs, other, fixed, eps)
    xt0 = torch.from_numpy(x0)

    def dev_sum(x: torch.Tensor, i: int) -> torch.Tensor:
        jac = torch.autograd.functional.jacobian(lambda z: model(z).reshape(-1), x,
                                                 create_graph=True).reshape(3, -1)
        u = torch.from_numpy(~fixed[i])
        return (jac[i] - torch.from_numpy(jcm[i])).abs()[u].sum()

    best = 0.0
    for i in range(3):
        if fixed[i].all():
            continue
        for _ in range(3):
            x = (xt0 + eps * torch.from_numpy(rng.choice([-1.0, 1.0], size=x0.shape))
                 ).requires_grad_(True)
            for _ in range(15):
                val = dev_sum(x, i)
                assert float(val) <= bound[i] * (1 + 1e-9), (float(val), bound[i])
                (gx,) = torch.autograd.grad(val, x)
                with torch.no_grad():
                    x = (xt0 + (x + 0.3 * eps * gx.sign() - xt0).clamp(-eps, eps)
                         ).requires_grad_(True)
            best = max(best, float(dev_sum(x, i)) / bound[i])
            assert float(dev_sum(x, i)) <= bound[i] * (1 + 1e-9)
    if not fixed.all():  # the bound is not vacuous: measured 0.22 on these models, so a
        assert best > 0.1, best  # 0.5x bound is not caught here (docs, Limits)
