"""The L2 attention's squared distances as one rule (affine/distances.py): every functional
of the form holds at the extreme points and random points of the ball, against the exact
float64 function; the walk reads a graph's Mul(d, d) / Pow(d, 2) then ReduceSum as the one
rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import linear as affine_linear
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.affine.distances import square_sum, square_sums
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.drivers.jacobian_walk import fused_chains
from lsa_models.engine.values import Ball
from lsa_models.onnx import load_onnx
from tests.onnx_export import export_to
from tests.profile import at_most
from tests.test_local_affine import EPS, NORM, P, _check, _points, _source, _symbols


def _pairwise(x: Aff, eps: float) -> Aff:
    """x_i - x_j for the rows of x (N, K): (N, N, K), the form of the exact difference (a
    difference of forms adds their boxes and margins, its rounding in the box)."""
    c = x.c[:, None, :] - x.c[None, :, :]
    o = x.o[:, None, :] - x.o[None, :, :]
    a = x.a[:, None, :, :] - x.a[None, :, :, :]
    u = 2.0 ** -52
    # the rounded coefficients' change within u of their sizes over the ball (eps |a_in|_1 +
    # |a_sym|_1 bounds it on either ball)
    size = np.abs(o) + np.abs(a).sum(axis=-1) * max(eps, 1.0)
    b = (x.b[:, None, :] + x.b[None, :, :] + u * size) * (1 + u) + 1e-300
    m = (x.m[:, None, :] + x.m[None, :, :] + u * np.abs(c)) * (1 + u)
    return Aff(c, m, o, a, b)


@settings(max_examples=at_most(300), deadline=None)  # an example costs ~20 ms
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM, scale=st.sampled_from([0.1, 1.0, 4.0]),
       keepdims=st.booleans(), off=st.booleans())
def test_square_sum_encloses_every_functional(seed: int, eps: float, norm: str, scale: float,
                                              keepdims: bool, off: bool) -> None:
    """sum_k (x_ik - x_jk)^2 of tanh rows (scaled: the linear part small or large beside the
    quadratic one), the centre moved within a margin where `off`: the rule's form holds."""
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        src, f = _source(rng, (3, 4), ball)
        x = affine_linear._scale_const(src, np.asarray(scale), scale * src.c,
                                       np.zeros((3, 4)), ball)
        if off:  # the centre known within m only
            shift = rng.uniform(-1e-9, 1e-9, size=x.c.shape)
            x = Aff(x.c + shift, x.m + np.abs(shift) * (1 + 1e-12), x.o, x.a, x.b)
        d = _pairwise(x, eps)

        def exact(z: torch.Tensor) -> torch.Tensor:
            q = scale * f(z)
            s = ((q[:, None, :] - q[None, :, :]) ** 2).sum(-1)
            return s[..., None] if keepdims else s
        out_c = exact(torch.zeros(P, dtype=torch.float64)).numpy()
        out = square_sum(d, keepdims, out_c, ball)
        assert out.shape == out_c.shape
        _check(exact, out, ball, rng)
        # the range too: every sampled value inside, the lower end where the sums are
        lo, hi = affine.ranges(out, ball)
        for z in _points(rng, ball, [rng.standard_normal(P)]):
            v = exact(torch.from_numpy(z)).numpy()
            assert np.all(lo <= v) and np.all(v <= hi), (lo, v, hi)


class _Distances(nn.Module):
    """Tokens (1, N, D) -> softmax(-||q_i - q_j||^2 / 2) @ x, q = x W, the square as
    Mul(d, d) or Pow(d, 2)."""

    def __init__(self, power: bool) -> None:
        super().__init__()
        self.power = power
        self.w = nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.tanh(x @ self.w)
        diff = q.unsqueeze(2) - q.unsqueeze(1)
        sq = diff.pow(2) if self.power else diff * diff
        return torch.softmax(-sq.sum(-1) / 2, dim=-1) @ x


@pytest.mark.parametrize("power", [False, True])
@pytest.mark.parametrize("norm", ["inf", "2"])
def test_walk_reads_squared_distances_as_one_rule(power: bool, norm: str,
                                                  tmp_path: Path) -> None:
    """The walk finds the square read by the sum, gives the sum one form whose functionals
    hold at the ball's extreme points, and the output's form holds too."""
    model = _Distances(power).eval()
    om = load_onnx(export_to(model, torch.zeros(1, 4, 4), tmp_path / "d.onnx", dynamo=True)
                   .read_bytes())
    module = om.module.with_dtype(torch.float64)
    x0 = np.random.default_rng(0).standard_normal((1, 4, 4))
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x0))
    nodes = list(module.runtime_nodes)
    found = square_sums(nodes, env)
    assert len(found) == 1
    total = next(iter(found.values())).outputs[0]
    chains, inside = fused_chains(om, module, env)
    rng = np.random.default_rng(1)
    for eps in (0.01, 0.2):
        ball = Ball(x0, eps, norm)
        forms = affine_rules.walk(nodes, om.spec.input_name, env, ball, chains, inside)
        assert total in forms and om.spec.output_name in forms
        for name in (total, om.spec.output_name):

            def run(d: torch.Tensor, name: str = name) -> torch.Tensor:
                with torch.no_grad():
                    return module.run_env(torch.from_numpy(x0) + d.reshape(x0.shape))[name]
            _check(run, forms[name], ball, rng)
