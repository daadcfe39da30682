"""The linear and layout ops' fast paths (affine/linear.py) and the walk's skipped finiteness
sums (affine/walk.py) against the reference arithmetic they replace (form.REFERENCE: every
linear op run through vmap over the widened columns, every layout gathered, every output
summed): the same coefficients, bit for bit, with the fast path taken."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.engine.affine import linear as affine_linear
from lsa_models.engine.affine import walk as affine_walk
from lsa_models.engine.affine.form import Aff, NotAffine
from lsa_models.engine.values import Ball, center_margin
from lsa_models.onnx.ops import Node
from tests.profile import at_most
from tests.test_affine_fast import _reference

BALL = Ball(np.zeros(3), 0.05, "inf")


def _form(rng: np.random.Generator, shape: tuple[int, ...], width: int) -> Aff:
    a = rng.standard_normal((*shape, width)) * (rng.random((*shape, width)) < 0.7)
    return Aff(rng.standard_normal(shape), np.abs(rng.standard_normal(shape)) * 1e-12,
               rng.standard_normal(shape) * 1e-3, a * 1e-2,
               np.abs(rng.standard_normal(shape)) * 1e-3)


def _both(node: Node, args: list, monkeypatch: pytest.MonkeyPatch) -> tuple[Aff, Aff]:
    """`linear` on args fast (asserting it never runs the op over the columns) and as the
    reference."""
    var = [i for i, v in enumerate(args) if isinstance(v, Aff)]
    if node.op_type.startswith("Reduce"):  # the centre's shape: the reduction's
        axes = node.attrs.get("axes", args[1].tolist() if len(args) > 1 else None)
        out_c = np.sum(args[0].c, axis=None if axes is None else tuple(axes),
                       keepdims=bool(node.attrs["keepdims"]))
        out_c = np.zeros(np.shape(out_c))
    else:
        out_c = np.zeros(np.broadcast_shapes(*(np.shape(v.c if isinstance(v, Aff) else v)
                                               for v in args)))
    out_m = center_margin(out_c)
    with _reference(True):
        ref = affine_linear.linear(node, args, var, out_c, out_m, BALL)

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the op ran over the columns")
    with monkeypatch.context() as m:
        m.setattr(affine_linear, "run_tangents", refuse)
        fast = affine_linear.linear(node, args, var, out_c, out_m, BALL)
    return fast, ref


def _same(f: Aff, r: Aff) -> None:
    for name in ("o", "a", "b"):
        u, v = getattr(f, name), getattr(r, name)
        assert u.shape == v.shape, name
        assert np.array_equal(u, v), (name, float(np.abs(u - v).max()))
    assert f.a.flags.c_contiguous


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches (widths, broadcasts on either side, operand order); the full profile's count only
# repeats them
@settings(max_examples=at_most(60), deadline=None)
@given(seed=st.integers(0, 10**6), op=st.sampled_from(["Add", "Sub"]), wx=st.integers(3, 9),
       wy=st.integers(3, 9), bx=st.booleans(), by=st.booleans(), const=st.integers(0, 2))
def test_broadcast_sums_are_the_ops_on_the_widened_columns(
        seed: int, op: str, wx: int, wy: int, bx: bool, by: bool, const: int) -> None:
    """x +- y with either operand broadcast along a token axis (an L2 attention's pairwise
    differences), or one operand a constant (0: both forms)."""
    rng = np.random.default_rng(seed)
    x = _form(rng, (2, 1 if bx else 4, 3), wx)
    y = _form(rng, (2, 4, 1) if by else (2, 4, 3), wy)
    args: list = [x, y]
    if const:
        args[const - 1] = rng.standard_normal(args[const - 1].shape)
    fast, ref = _both(Node("n", op, ["x", "y"], ["z"]), args, pytest.MonkeyPatch())
    _same(fast, ref)


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches; the full profile's count only repeats them
@settings(max_examples=at_most(60), deadline=None)
@given(seed=st.integers(0, 10**6), op=st.sampled_from(["Mul", "Div", "Neg"]),
       kshape=st.sampled_from([(), (1,), (3,), (4, 1), (4, 3), (2, 1, 1)]),
       first=st.booleans(), f32=st.booleans())
def test_products_by_constants_are_the_ops_on_the_columns(
        seed: int, op: str, kshape: tuple[int, ...], first: bool, f32: bool) -> None:
    rng = np.random.default_rng(seed)
    x = _form(rng, (2, 4, 3), 7)
    k = rng.standard_normal(kshape) * 3 + 0.5
    k = k.astype(np.float32) if f32 else k
    if op == "Neg":
        args: list = [x]
    else:
        args = [x, k] if first or op == "Div" else [k, x]
    fast, ref = _both(Node("n", op, ["x", "k"][:len(args)], ["z"]), args,
                      pytest.MonkeyPatch())
    _same(fast, ref)


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches (the row sums' layout and torch's own reduction otherwise); the full profile's
# count only repeats them
@settings(max_examples=at_most(80), deadline=None)
@given(seed=st.integers(0, 10**6), op=st.sampled_from(["ReduceSum", "ReduceMean"]),
       shape=st.sampled_from([(2, 3, 8), (1, 4, 6, 5, 8), (3, 17), (2, 5, 63), (1, 64),
                              (4, 1, 1), (2, 3, 4)]),
       axes=st.sampled_from([[-1], [0], [1], [0, -1], None]), keep=st.booleans(),
       width=st.integers(1, 40), as_input=st.booleans())
def test_reductions_are_the_ops_reductions_over_the_columns(
        seed: int, op: str, shape: tuple[int, ...], axes: list[int] | None, keep: bool,
        width: int, as_input: bool) -> None:
    """Sums and means over one axis (the last: the row sums in torch's order), several or
    all of them, axes as an attribute or as the second input (opset 18)."""
    rng = np.random.default_rng(seed)
    x = _form(rng, shape, width)
    attrs: dict = {"keepdims": int(keep)}
    args: list = [x]
    if axes is not None and as_input:
        args.append(np.asarray(axes, dtype=np.int64))
    elif axes is not None:
        attrs["axes"] = axes
    node = Node("n", op, ["x", "axes"][:len(args)], ["z"], attrs)
    fast, ref = _both(node, args, pytest.MonkeyPatch())
    _same(fast, ref)


def test_the_row_sums_are_taken_and_follow_torchs_order() -> None:
    """The L2 attention's squared distances summed over the head's 8 entries: `_row_sums`
    gives them (not None) and vmap's floats, which a plain left-to-right sum does not."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1, 4, 16, 16, 8, 50))
    got = affine_linear._row_sums(a, (4,), False, False)
    assert got is not None
    x = Aff(*(np.zeros(a.shape[:-1]) for _ in range(3)), a, np.zeros(a.shape[:-1]))
    with _reference(True):
        ref = affine_linear.linear(Node("n", "ReduceSum", ["x"], ["z"], {"axes": [-1],
                                                                        "keepdims": 0}),
                                   [x], [0], np.zeros(a.shape[:-2]), np.zeros(a.shape[:-2]),
                                   BALL)
    assert np.array_equal(got, ref.a)
    plain = a[..., 0, :].copy()
    for i in range(1, 8):
        plain += a[..., i, :]
    assert not np.array_equal(plain, ref.a)


def _layout(node: Node, x: Aff, centers: list) -> tuple[list, list]:
    fast = affine_linear.layout(node, [x], centers, 3)
    with _reference(True):
        ref = affine_linear.layout(node, [x], centers, 3)
    return fast, ref


def test_slices_of_leading_axes_are_views_with_the_gathered_numbers() -> None:
    """A Slice of the leading axes (q, k, v out of one projection) and a Split: views of the
    form's rows, C-contiguous, equal to the gathered copies; a Slice of an inner axis is
    gathered."""
    rng = np.random.default_rng(1)
    x = _form(rng, (3, 1, 4, 5, 2), 9)
    for axis, view in ((0, True), (2, False)):
        node = Node("s", "Slice", ["x", "st", "en", "ax"], ["y"])
        starts, ends = np.array([1]), np.array([2])
        args = [x, starts, ends, np.array([axis])]
        fast = affine_linear.layout(node, args, [np.zeros(1)], 3)
        with _reference(True):
            ref = affine_linear.layout(node, args, [np.zeros(1)], 3)
        (f,), (r,) = fast, ref
        _same(f, r)
        assert np.shares_memory(f.a, x.a) == view
    node = Node("s", "Split", ["x"], ["y0", "y1"], {"axis": 0, "num_outputs": 2})
    outs = affine_linear.layout(node, [x, np.array([1, 2])], [np.zeros(1), np.zeros(1)], 3)
    with _reference(True):
        refs = affine_linear.layout(node, [x, np.array([1, 2])], [np.zeros(1), np.zeros(1)], 3)
    for f, r in zip(outs, refs, strict=True):
        _same(f, r)
        assert np.shares_memory(f.a, x.a)


def _step(node: Node, args: list, shape: tuple[int, ...]) -> list:
    return affine_walk.step(node, args, [np.zeros(shape)], BALL, lambda i: None)


def test_a_layout_of_checked_coefficients_is_not_summed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Transpose of a form whose coefficients a step found finite skips their sum; one of
    a form no step checked (a seed: here with an infinite coefficient) is summed and
    refused, as is a linear op's output."""
    rng = np.random.default_rng(2)
    x = _form(rng, (4, 64, 8), 300)  # above the size the walk notes
    node = Node("t", "Transpose", ["x"], ["y"], {"perm": [1, 0, 2]})
    (y,) = _step(Node("n", "Neg", ["x"], ["y"]), [x], (4, 64, 8))
    seen: list[int] = []
    finite = affine_walk._finite

    def spy(v: np.ndarray) -> bool:
        seen.append(v.size)
        return finite(v)
    monkeypatch.setattr(affine_walk, "_finite", spy)
    (z,) = _step(node, [y], (64, 4, 8))
    assert z.a.size not in seen and len(seen) == 2  # the offset and the box only
    bad = Aff(x.c, x.m, x.o, x.a.copy(), x.b)
    bad.a[1, 2, 3, 4] = np.inf
    with pytest.raises(NotAffine):
        _step(node, [bad], (64, 4, 8))
    with pytest.raises(NotAffine):
        _step(Node("n", "Neg", ["x"], ["y"]), [bad], (4, 64, 8))


# bit-for-bit copies: a few dozen random layouts cover the tiling branches; the full
# profile's count only repeats them
@settings(max_examples=at_most(30), deadline=None)
@given(seed=st.integers(0, 10**6), lead=st.sampled_from([(3,), (2, 300), (1, 4, 70), (600,)]),
       p=st.integers(1, 700))
def test_column_last_copies_are_the_arrays(seed: int, lead: tuple[int, ...], p: int) -> None:
    """`_column_last` on vmap's layout (the column axis slowest: tiles, ragged at the ends)
    and on another strided array: C-contiguous, the same floats."""
    rng = np.random.default_rng(seed)
    front = rng.standard_normal((p, *lead))
    a = np.moveaxis(front, 0, -1)
    got = affine_linear._column_last(a)
    assert got.flags.c_contiguous and np.array_equal(got, a)
    b = rng.standard_normal((*lead, 2 * p))[..., ::2]
    got = affine_linear._column_last(b)
    assert got.flags.c_contiguous and np.array_equal(got, b)


def test_a_matmul_by_a_batched_constant_is_copied_column_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """X W for a 3-D constant W (an L2 attention's per-head weights) runs through vmap; its
    strided result copied by tiles is the reference's copy."""
    rng = np.random.default_rng(3)
    x = _form(rng, (1, 4, 16, 8), 300)
    w = rng.standard_normal((4, 8, 32))
    node = Node("m", "MatMul", ["x", "w"], ["y"])
    out_c = np.zeros((1, 4, 16, 32))
    with _reference(True):
        ref = affine_linear.linear(node, [x, w], [0], out_c, center_margin(out_c), BALL)
    tiled: list[int] = []
    column_last = affine_linear._column_last

    def spy(a: np.ndarray) -> np.ndarray:
        tiled.append(a.size)
        return column_last(a)
    monkeypatch.setattr(affine_linear, "_column_last", spy)
    fast = affine_linear.linear(node, [x, w], [0], out_c, center_margin(out_c), BALL)
    _same(fast, ref)
    assert tiled == [ref.a.size]
