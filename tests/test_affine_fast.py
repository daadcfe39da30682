"""The affine walk's fast paths (docs/local-affine.md, "Speed") against the reference
arithmetic they replace (affine.REFERENCE: widened copies, np.where over whole arrays, every
linear op run column by column): the same numbers, bit for bit, piece by piece and for the
margins' lower bounds of whole walks, which also hold against PGD on the float64 model."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import linear as affine_linear
from lsa_models.engine.affine import products as affine_products
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.drivers.margins import margin_lower_bounds
from lsa_models.engine.values import Ball
from lsa_models.onnx import load_onnx
from tests.margins import descend_margin
from tests.profile import at_most

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from local_models import build, center, export  # noqa: E402


@contextmanager
def _reference(on: bool) -> Iterator[None]:
    saved = affine.REFERENCE
    affine.REFERENCE = on
    try:
        yield
    finally:
        affine.REFERENCE = saved


@contextmanager
def _symbols(p: int, used: int, groups: bool) -> Iterator[list[int]]:
    space = [p, used, 0]
    t1 = affine.SPACE.set(space)
    t2 = affine.GROUPS.set([] if groups else None)
    try:
        yield space
    finally:
        affine.GROUPS.reset(t2)
        affine.SPACE.reset(t1)


def _same(u: np.ndarray, v: np.ndarray) -> None:
    assert u.shape == v.shape
    assert np.array_equal(u, v), float(np.abs(u - v).max())


def _form(rng: np.random.Generator, shape: tuple[int, ...], width: int,
          zero_rows: float = 0.0) -> Aff:
    a = rng.standard_normal((*shape, width))
    a[rng.random(shape) < zero_rows] = 0.0
    return Aff(rng.standard_normal(shape), np.abs(rng.standard_normal(shape)) * 1e-12,
               rng.standard_normal(shape) * 1e-3, a * 1e-2,
               np.abs(rng.standard_normal(shape)) * 1e-3)


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches (widths, zero rows, broadcasts); the full profile's count only repeats them
@settings(max_examples=at_most(60), deadline=None)
@given(seed=st.integers(0, 10**6), wu=st.integers(1, 9), wv=st.integers(1, 9),
       extra=st.integers(0, 3), sub=st.booleans(), bcast=st.booleans())
def test_sum_cols_is_the_sum_of_the_widened_arrays(seed: int, wu: int, wv: int, extra: int,
                                                   sub: bool, bcast: bool) -> None:
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((3, 4, wu))
    v = rng.standard_normal((1 if bcast else 3, 4, wv))
    n = max(wu, wv) + extra
    fast = affine_products._sum_cols(u, v, n, sub)
    with _reference(True):
        ref = affine_products._sum_cols(u, v, n, sub)
    _same(fast, ref)


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches (widths, zero rows, broadcasts); the full profile's count only repeats them
@settings(max_examples=at_most(60), deadline=None)
@given(seed=st.integers(0, 10**6), width=st.integers(3, 12), used=st.integers(0, 6),
       groups=st.booleans(), budget=st.booleans())
def test_fresh_fill_widens_as_fresh_did(seed: int, width: int, used: int, groups: bool,
                                        budget: bool) -> None:
    """The new symbols' columns, the box, the symbol count and the recorded group of
    `fresh_fill` are those of the reference `fresh` (np.zeros, then the copy)."""
    rng = np.random.default_rng(seed)
    p = 3
    a = rng.standard_normal((2, 5, width))
    b = np.abs(rng.standard_normal((2, 5)))
    err = np.where(rng.random((2, 5)) < 0.3, 0.0, np.abs(rng.standard_normal((2, 5))))
    bud = float(err.sum()) * 0.5 if budget else None
    out = []
    for ref in (False, True):
        with _reference(ref), _symbols(p, max(used, width - p), groups) as space:
            got = affine.fresh_fill(lambda o: np.multiply(a, 2.0, out=o), width, b, err, bud)
            out.append((got, list(space), affine.GROUPS.get()))
    (fa, fb), fs, fg = out[0]
    (ra, rb), rs, rg = out[1]
    _same(fa, ra)
    _same(fb, rb)
    assert fs == rs
    assert (fg is None) == (rg is None)
    if fg is not None and rg is not None:
        assert len(fg) == len(rg)
        for (g0, g1, w), (h0, h1, v) in zip(fg, rg, strict=True):
            assert (g0, g1) == (h0, h1)
            _same(w, v)


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches (widths, zero rows, broadcasts); the full profile's count only repeats them
@settings(max_examples=at_most(40), deadline=None)
@given(seed=st.integers(0, 10**6), wx=st.integers(4, 10), wy=st.integers(4, 10),
       norm=st.sampled_from(["inf", "2"]))
def test_select_and_narrow_match_the_reference(seed: int, wx: int, wy: int, norm: str
                                               ) -> None:
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(3), 0.1, norm)
    x = _form(rng, (4, 3), wx, zero_rows=0.2)
    y = Aff(x.c, x.m, x.o * 0.5, rng.standard_normal((4, 3, wy)) * rng.random((4, 3, 1))
            * 2e-2, x.b * rng.random((4, 3)) * 2)
    lo, hi = affine.ranges(x, ball)
    mid = 0.5 * (lo + hi)
    nlo = np.where(rng.random((4, 3)) < 0.5, mid - 1e-6, lo)
    nhi = np.where(nlo > lo, mid + 1e-6, hi)
    got = []
    for ref in (False, True):
        with _reference(ref), _symbols(3, max(wx, wy) - 3, False):
            got.append((affine.select(x, y, ball), affine.narrow(x, nlo, nhi, ball)))
    for f, r in zip(got[0], got[1], strict=True):
        for name in ("o", "a", "b"):
            _same(getattr(f, name), getattr(r, name))


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches (widths, zero rows, broadcasts); the full profile's count only repeats them
@settings(max_examples=at_most(40), deadline=None)
@given(seed=st.integers(0, 10**6), tokens=st.integers(1, 9), d=st.integers(2, 40),
       q=st.integers(1, 9000), bcast=st.booleans())
def test_weighted_sum_by_blocks_is_the_whole_sum(seed: int, tokens: int, d: int, q: int,
                                                 bcast: bool) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((1, tokens, d, q))
    w = rng.standard_normal((1, 1 if bcast else tokens, d))
    fast = affine_linear._weighted_cols(w, a)
    with _reference(True):
        ref = affine_linear._weighted_cols(w, a)
    _same(fast, ref)


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches (widths, zero rows, broadcasts); the full profile's count only repeats them
@settings(max_examples=at_most(30), deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 300), wu=st.integers(6, 3000),
       wv=st.integers(6, 3000), norm=st.sampled_from(["inf", "2"]), groups=st.booleans(),
       sub=st.booleans())
def test_lin_of_a_sum_by_blocks_is_lin_of_the_whole_sum(seed: int, rows: int, wu: int,
                                                        wv: int, norm: str, groups: bool,
                                                        sub: bool) -> None:
    """`_lin_of_sum` (the rank-one bound's sizes, a block of rows at a time) against `lin`
    of the whole sum, with symbol groups among the columns."""
    rng = np.random.default_rng(seed)
    p = 5
    ball = Ball(np.zeros(p), 0.05, norm)
    u = rng.standard_normal((rows, wu)) * (rng.random((rows, wu)) < 0.3)
    v = rng.standard_normal((rows, wv))
    n = max(wu, wv)
    with _symbols(p, n - p, groups):
        if groups:
            g1 = min(n, p + 40)
            w = rng.random(g1 - p) + 0.1
            affine.GROUPS.get().append((p, g1, w))  # type: ignore[union-attr]
        fast = affine_products._lin_of_sum(u, v, n, sub, ball)
        with _reference(True):
            ref = affine_products._lin_of_sum(u, v, n, sub, ball)
    _same(fast, ref)


def _model(kind: str, tmp: Path):  # type: ignore[no-untyped-def]
    return load_onnx(export(build(kind), tmp / f"{kind}.onnx").read_bytes())


@pytest.mark.parametrize("kind", ["tf1", "tf2"])
def test_fast_walk_gives_the_reference_margins_and_holds_against_pgd(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole walks (plain, second order; eigenvalues on the 2-ball) on the Transformer
    classifiers: every margin's lower bound equal to the reference arithmetic's (so never
    looser), the fast paths taken, and no margin PGD reaches inside the ball below it."""
    om = _model(kind, tmp_path)
    x0 = center().numpy().astype(np.float64)
    f = om.module.with_dtype(torch.float64)
    label = int(f(torch.from_numpy(x0)).reshape(-1).argmax())
    taken = {"layout": 0, "additive": 0}
    one, add = affine_linear._layout_one, affine_linear._additive

    def spy_layout(*a, **k):  # type: ignore[no-untyped-def]
        out = one(*a, **k)
        taken["layout"] += out is not None
        return out

    def spy_add(*a, **k):  # type: ignore[no-untyped-def]
        out = add(*a, **k)
        taken["additive"] += out is not None
        return out
    monkeypatch.setattr(affine_linear, "_layout_one", spy_layout)
    monkeypatch.setattr(affine_linear, "_additive", spy_add)
    for norm, eps, stages in (("inf", 0.01, ((False, False), (True, False))),
                              ("2", 0.1, ((False, False), (True, True)))):
        for quad, eig in stages:
            fast = margin_lower_bounds(om, x0, eps, norm, label, quad=quad, eig=eig)
            with _reference(True):
                ref = margin_lower_bounds(om, x0, eps, norm, label, quad=quad, eig=eig)
            assert fast is not None and ref is not None and set(fast) == set(ref)
            assert all(fast[j] == ref[j] for j in ref), (norm, quad, eig, fast, ref)
        gen = torch.Generator().manual_seed(1)
        for j, bound in fast.items():
            d = (torch.rand(x0.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
            if norm == "2":
                d = d * (eps / float(d.norm()))
            for m in descend_margin(f, torch.from_numpy(x0), label, j, eps, norm, d,
                                    steps=15):
                assert m >= bound
    assert taken["layout"] > 0 and taken["additive"] > 0


def test_relu_mlp_walk_is_the_reference_walk_bit_for_bit(tmp_path: Path) -> None:
    """A ReLU MLP's tangent columns come back strided from the op: kept so, the next Gemm's
    BLAS kernel sums in another order and a margin moves by ulps (either way). The fast walk
    copies them as the reference does, so its margins are the reference's exactly."""
    from local_models import relu_mlp

    om = load_onnx(export(relu_mlp(0), tmp_path / "relu_mlp.onnx").read_bytes())
    x0 = center(1).numpy().astype(np.float64)
    for norm, eps in (("inf", 0.0095), ("inf", 0.0087), ("2", 0.05)):
        fast = margin_lower_bounds(om, x0, eps, norm, 0)
        with _reference(True):
            ref = margin_lower_bounds(om, x0, eps, norm, 0)
        assert fast is not None and ref is not None
        assert all(fast[j] == ref[j] for j in ref), (norm, eps, fast, ref)


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches; the full profile's count only repeats them
@settings(max_examples=at_most(40), deadline=None)
@given(seed=st.integers(0, 10**6), lead=st.sampled_from([(), (1,), (3,), (2, 5)]),
       n=st.integers(1, 300), zeros=st.floats(0.0, 0.9))
def test_knapsack_in_one_buffer_is_the_formula_bit_for_bit(seed: int, lead: tuple[int, ...],
                                                            n: int, zeros: float) -> None:
    """affine.knapsack (its fractions in one buffer) against the formula it computes:
    the items by c / w, the fractions clip((1 - (cumsum(w) - w)) / w, 0, 1)."""
    rng = np.random.default_rng(seed)
    c = np.abs(rng.standard_normal((*lead, n))) * (rng.random((*lead, n)) >= zeros)
    w = rng.random(n) * 2.0 / n + 1e-3
    order = np.argsort(-(c / w), axis=-1)
    cs = np.take_along_axis(c, order, axis=-1)
    ws = w[order]
    frac = np.clip((1.0 - (np.cumsum(ws, axis=-1) - ws)) / ws, 0.0, 1.0)
    _same(affine.knapsack(c, w), (cs * frac).sum(axis=-1) * (1 + 1e-10))


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches; the full profile's count only repeats them
@settings(max_examples=at_most(60), deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 60), n=st.integers(1, 400),
       zeros=st.floats(0.0, 0.99), scale=st.sampled_from([0.2, 1.0, 3.0, 50.0]))
def test_group_sum_is_the_smaller_of_sum_and_knapsack_bit_for_bit(
        seed: int, rows: int, n: int, zeros: float, scale: float) -> None:
    """affine.group_sum (the knapsack solved only on the rows whose items do not all fit)
    against min(sum, knapsack) on every row: weights summing to about `scale` over the
    group, so rows with few nonzero items fit and the others do not, ties at 1 included."""
    rng = np.random.default_rng(seed)
    c = np.abs(rng.standard_normal((rows, n))) * (rng.random((rows, n)) >= zeros)
    w = rng.random(n) + 1e-3
    w *= scale / w.sum()
    ref = np.minimum(c.sum(axis=-1), affine.knapsack(c, w))
    _same(affine.group_sum(c, w), ref)
    _same(affine.group_sum(c[0], w), np.minimum(c[0].sum(), affine.knapsack(c[0], w)))
    # a row whose items weigh exactly 1 together
    edge = np.zeros(n)
    edge[0] = 1.0
    one = np.ones(n)
    _same(affine.group_sum(edge[None], one), np.minimum(edge[None].sum(axis=-1),
                                                          affine.knapsack(edge[None], one)))


def test_a_difference_negates_the_subtrahends_extra_columns_exactly() -> None:
    """x - y where y has more symbols than x: the columns only y holds are -y's, bit for bit
    (numpy 2.4's np.negative from a strided input into a strided `out` view wrote wrong
    entries on this layout: 3 x 4 tokens, 7 and 8 symbols, 11 columns)."""
    rng = np.random.default_rng(2)
    u, v = rng.standard_normal((3, 4, 7)), rng.standard_normal((3, 4, 8))
    out = affine_products._sum_cols(u, v, 11, sub=True)
    assert np.array_equal(out[..., :7], u - v[..., :7])
    assert np.array_equal(out[..., 7], -v[..., 7]) and not out[..., 8:].any()
    x, y = _form(rng, (3, 4), 7), _form(rng, (3, 4), 8)
    node = SimpleNamespace(op_type="Sub")
    a = affine_linear._additive(node, [x, y], [0, 1], [x, y], 11)  # type: ignore[arg-type]
    assert a is not None
    assert np.array_equal(a[..., :7], x.a - y.a[..., :7])
    assert np.array_equal(a[..., 7], -y.a[..., 7]) and not a[..., 8:].any()
