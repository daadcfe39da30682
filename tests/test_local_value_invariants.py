"""Every LocalValue the walk leaves holds the invariants values.py states for it, at points of
the ball: the enclosure (lo <= T(X) <= hi, |J(X) - jc| <= jr) and, where set, the 2-ball's
norms (jnorm, tok_jn, tok_rad, tok_true) and the inf-ball's second-order annotations (nonlin,
jfac), on a one-layer Transformer (2-ball) and an MLP (inf-ball) walked with the telescope as
local_jacobian walks them; and each value's OpRemainder answers an adjoint in its forms."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lsa_models.engine.drivers.centre import Centre
from lsa_models.engine.drivers.jacobian_walk import walk
from lsa_models.engine.enclosure.rules_more import gelu_tanh
from lsa_models.engine.remainders.structured_norms import alternatives
from lsa_models.engine.remainders.telescope import Telescope, adjoint_rows
from lsa_models.engine.values import Ball, LocalValue, center_margin, input_value
from lsa_models.onnx import load_onnx
from tests.jacobians import ball_points

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from local_models import build, center, export  # noqa: E402

# float64 evaluation of T(X) and J(X) at a point, against bounds on the true values
REL = 1e-10


def _walked(tmp_path: Path, norm: str, eps: float, kind: str
            ) -> tuple[object, np.ndarray, dict]:
    om = load_onnx(export(build(kind, 0), tmp_path / f"{kind}.onnx").read_bytes())
    x0 = center(1).numpy().astype(np.float64)
    with Centre(om, x0) as ctr:
        zero, _ = walk(om, ctr.module, ctr.env, Ball(x0, 0.0, norm), None)
        tight = Telescope(om, x0, zero)
        tight.signed_terms = norm == "inf"
        values, _ = walk(om, ctr.module, ctr.env, Ball(x0, eps, norm), tight)
    return om, x0, {n: v for n, v in values.items() if isinstance(v, LocalValue)}


def _at(om: object, x: np.ndarray, names: list[str]
        ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """T(X) and J(X) (rows: T's entries, (K, P)) of every named tensor, float64."""
    module = om.module.with_dtype(torch.float64)  # type: ignore[attr-defined]
    xt = torch.from_numpy(x).requires_grad_(True)
    env = module.run_env(xt)
    vals, jacs = {}, {}
    for n in names:
        t = env[n].reshape(-1)
        vals[n] = t.detach().numpy().copy()
        rows = adjoint_rows(t, [xt])
        jacs[n] = np.stack([np.zeros(x.size) if r[0] is None else
                            r[0].detach().numpy().reshape(-1) for r in rows])
    return vals, jacs


def _tokens(a: np.ndarray, d: int) -> np.ndarray:
    return np.sqrt(np.square(a.reshape(-1, d)).sum(axis=1))


def _check_norms(v: LocalValue, t: np.ndarray, j: np.ndarray, c: np.ndarray) -> int:
    """The 2-ball's norms (the token radii are set on either ball) at one point; the number
    of annotations checked."""
    seen = 0
    d = v.shape[-1]
    if v.jnorm is not None:
        assert np.linalg.norm(j, ord=2) <= v.jnorm * (1 + REL)
        seen += 1
    if v.tok_jn is not None:
        tj = [np.linalg.norm(j[i:i + d], ord=2) for i in range(0, j.shape[0], d)]
        assert np.all(np.array(tj) <= v.tok_jn.reshape(-1) * (1 + REL))
        seen += 1
    if v.tok_rad is not None:
        assert np.all(_tokens(t - c, d) <= v.tok_rad.reshape(-1) * (1 + REL))
        assert np.all(np.abs(t - c) <= v.tok_rad.repeat(d, axis=-1).reshape(-1) * (1 + REL))
        seen += 1
    if v.tok_true is not None:  # around the true centre: the computed one within its margin
        slack = _tokens(center_margin(v.center), d)
        assert np.all(_tokens(t - c, d) <= (v.tok_true.reshape(-1) + slack) * (1 + REL))
        seen += 1
    return seen


def _check_second(v: LocalValue, t: np.ndarray, j: np.ndarray, c: np.ndarray, dx: np.ndarray,
                  eps: float) -> int:
    """The inf-ball's second-order annotations at one point; the number checked."""
    seen = 0
    jc = v.jc.reshape(c.size, -1)
    if v.nonlin is not None and v.nonlin[0] == eps:
        gap = np.abs(t - c - jc @ dx)
        slack = center_margin(v.center).reshape(-1)
        assert np.all(gap <= (v.nonlin[1].reshape(-1) + slack) * (1 + REL) + 1e-300)
        seen += 1
    if v.jfac is not None:  # |J(X) - jc| <= |M| diag(dmb) |src| + rest, what it implies
        m, dmb, src, rest = v.jfac
        bound = (np.abs(m.reshape(c.size, -1)) * dmb) @ np.abs(src) + rest.reshape(c.size, -1)
        assert np.all(np.abs(j - jc) <= bound * (1 + REL) + 1e-300)
        seen += 1
    return seen


def _pressing(values: dict[str, LocalValue], eps: float, norm: str) -> list[np.ndarray]:
    """Offsets on the boundary that press the annotated values hardest to first order: per
    annotated tensor, its centre Jacobian's top right singular vector (2) or the signs of
    its largest row (inf), times eps."""
    out = []
    for v in values.values():
        if v.tok_rad is None and v.nonlin is None and v.jnorm is None:
            continue
        jc = v.jc.reshape(v.center.size, -1)
        d = np.linalg.svd(jc)[2][0] if norm == "2" else \
            np.sign(jc[np.abs(jc).sum(axis=1).argmax()])
        out.append(eps * d / max(np.linalg.norm(d, ord=2 if norm == "2" else np.inf), 1e-300))
    return out


@pytest.mark.parametrize(("kind", "norm", "eps"), [("tf1", "2", 0.05), ("mlp", "inf", 0.05)])
def test_every_value_holds_its_invariants_at_points_of_the_ball(kind: str, norm: str,
                                                                 eps: float,
                                                                 tmp_path: Path) -> None:
    om, x0, values = _walked(tmp_path, norm, eps, kind)
    names = sorted(values)
    c0, _ = _at(om, x0, names)
    rng = np.random.default_rng(7)
    seen = 0
    for dx in ball_points(rng, x0.size, eps, norm, k=4) + _pressing(values, eps, norm):
        ts, js = _at(om, x0 + dx.reshape(x0.shape), names)
        for n in names:
            v, t, j, c = values[n], ts[n], js[n], c0[n]
            k = c.size
            slack = REL * (1 + np.abs(t))
            assert np.all(v.lo.reshape(-1) - slack <= t) and np.all(t <= v.hi.reshape(-1) + slack)
            jc, jr = v.jc.reshape(k, -1), v.jr.reshape(k, -1)
            assert np.all(np.abs(j - jc) <= jr * (1 + REL) + REL * np.abs(j).max(initial=0.0))
            seen += _check_norms(v, t, j, c) + _check_second(v, t, j, c, dx, eps)
    assert seen > 0, "no value carried the annotations this test checks"


@pytest.mark.parametrize(("kind", "norm"), [("tf1", "2"), ("tf1", "inf")])
def test_every_remainder_gives_its_forms_for_one_adjoint(kind: str, norm: str,
                                                         tmp_path: Path) -> None:
    """Each value's OpRemainder (values.py) answers an adjoint G (K, *S) as its forms state:
    term (K, P) >= 0, parts' (c (K, n) >= 0, jc_in, jr_in (n, P)), opnorm a float >= 0 on
    the 2-ball, the second-order rule on the inf-ball; one frozen object per op."""
    _, x0, values = _walked(tmp_path, norm, 0.01, kind)
    rng = np.random.default_rng(3)
    p, k = x0.size, 2
    kinds: set[str] = set()
    for v in values.values():
        rem = v.remainder
        if rem is None:
            continue
        assert v.term is rem.term and v.parts is rem.parts
        with pytest.raises(dataclasses.FrozenInstanceError):
            rem.term = rem.term  # type: ignore[misc]
        g = rng.standard_normal((k, *v.shape))
        t = rem.term(np.abs(g))
        assert t.shape == (k, p) and np.all(t >= 0) and np.all(np.isfinite(t))
        kinds.add("term")
        if rem.parts is not None:
            for alt in alternatives(rem.parts(np.abs(g))):
                for c, jc_in, jr_in in alt:
                    assert c.shape == (k, jc_in.shape[0]) and np.all(c >= 0)
                    assert jc_in.shape == jr_in.shape == (c.shape[1], p) and np.all(jr_in >= 0)
            kinds.add("parts")
        if rem.opnorm is not None:
            assert norm == "2" and rem.opnorm(g) >= 0.0
            kinds.add("opnorm")
        if rem.second is not None:
            assert norm == "inf"
            hess, rest = rem.second(g, np.abs(g), 0.01)
            assert np.all(rest >= 0) and np.all(np.isfinite(hess))
            kinds.add("second")
    assert kinds >= {"term", "parts", "opnorm" if norm == "2" else "second"}


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_the_fused_gelu_chain_bounds_its_remainder_in_every_form(norm: str) -> None:
    """gelu_tanh's OpRemainder bounds the whole chain's R(G) = G (D(X) - D(X0)) (its input the
    ball's own, J_in = I) at points of the ball: the term, and the parts summed over every
    link with their inputs' Jacobian enclosures."""
    rng = np.random.default_rng(11)
    x0 = rng.uniform(-2.0, 2.0, 12)
    eps = 0.5 if norm == "2" else 0.2
    ball = Ball(x0, eps, norm)
    xt = torch.from_numpy(x0)
    y0 = torch.nn.functional.gelu(xt, approximate="tanh").numpy()
    y = gelu_tanh(input_value(ball), y0, ball)
    assert y.remainder is not None and y.remainder.parts is not None

    def slope(x: np.ndarray) -> np.ndarray:
        xv = torch.from_numpy(x).requires_grad_(True)
        torch.nn.functional.gelu(xv, approximate="tanh").sum().backward()
        assert xv.grad is not None
        return xv.grad.numpy()

    g = rng.standard_normal((3, x0.size))
    term = y.remainder.term(np.abs(g))
    via = sum(c @ (np.abs(jc) + jr) for alt in alternatives(y.remainder.parts(np.abs(g)))[:1]
              for c, jc, jr in alt)
    for dx in ball_points(rng, x0.size, eps, norm, k=64):
        r = np.abs(g * (slope(x0 + dx) - slope(x0)))  # (K, P): D diagonal, J_in = I
        assert np.all(r <= term * (1 + REL) + 1e-300)
        assert np.all(r <= via * (1 + REL) + 1e-300)
