"""The affine forms' rules (affine/form.py has the form and its invariant), one node at a time
(`step`) and a standalone walk (`walk`); derivations in docs/local-affine.md, "Affine value
forms". The rules themselves live by kind: affine/elementwise.py (elementwise functions),
affine/products.py (products of two forms), affine/linear.py (linear and layout ops),
affine/norms.py (LayerNorm, RMSNorm, softmax, division), affine/masks.py (attention masks,
Where, guards); their entry points are re-exported here."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

from lsa_models.engine import elementwise_chains as fused
from lsa_models.engine.affine.distances import square_sum_step, square_sums
from lsa_models.engine.affine.elementwise import (
    EXP,
    RECIPROCAL,
    RELU,
    RSQRT,
    SQRT,
    SQUARE,
    Fn,
    activation_fn,
    chain_fn,
    elementwise,
    relaxation_fn,
)
from lsa_models.engine.affine.form import (
    QUAD,
    SPACE,
    TINY,
    Aff,
    NotAffine,
    fresh,
    input_form,
    interval,
    quad_size,
    ranges,
    reference,
)
from lsa_models.engine.affine.linear import _weighted_cols, layout, linear, weighted_sum
from lsa_models.engine.affine.masks import _masks, _unmask
from lsa_models.engine.affine.norms import (
    _divide,
    _hi,
    _lo,
    _softmax_or_interval,
    layernorm,
    norm_parts,
    softmax,
    variance,
)
from lsa_models.engine.affine.products import product
from lsa_models.engine.derivative_ops import RELU_GRAD
from lsa_models.engine.values import Ball, center_margin
from lsa_models.onnx.ops import FLOAT_TYPES, Node, decimal_attr
from lsa_models.operators import ARITHMETIC_TYPES, FUSABLE_ACTIVATIONS, activation, arithmetic
from lsa_models.operators.arithmetic import Arithmetic, Pow

# --- one node ---

LAYOUT = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice",
          "Gather", "Concat", "Split", "Expand", "Dropout", "Tile")
LINEAR = ("Add", "Sub", "Neg", "Mul", "Div", "MatMul", "Gemm", "ReduceMean", "ReduceSum",
          "Conv")
SINGLE = FUSABLE_ACTIVATIONS  # smooth activations: as one-node chains (elementwise_chains.py)


def _arithmetic(node: Node) -> Arithmetic:
    op = arithmetic(node.op_type, node.attrs)
    assert op is not None
    return op


def _power(node: Node, args: list) -> Fn:
    """x^2, sqrt x, 1/x, x^-1/2: Pow by a constant exponent (RMSNorm's x.pow(2))."""
    e = args[1]
    if isinstance(e, Aff):
        raise NotAffine(f"Pow node {node.name}: an input-dependent exponent")
    ev = np.asarray(e, dtype=np.float64).reshape(-1)
    if ev.size != 1:
        raise NotAffine(f"Pow node {node.name}: no affine rule for this exponent")
    return relaxation_fn(Pow("Pow", {"exponent": float(ev[0])}), node.name)


def step(node: Node, args: list, centers: list[np.ndarray | None], ball: Ball,
         ranges_of: Callable[[int], tuple[np.ndarray, np.ndarray] | None],
         chain: fused.Chain | None = None, consts: dict[str, float] | None = None) -> list:
    """The forms of one node's outputs (None where it has no output or no rule).
    `args`: Aff for input-dependent inputs, arrays for constants; `ranges_of(i)`: a known
    range of input i (the Jacobian enclosure's), or None. NotAffine: no rule, or a form
    overflowed (the caller falls back to the interval of the enclosure, or stops)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = _step(node, args, centers, ball, ranges_of, chain, consts)
    # a layout op's coefficients are its inputs' (and zeros): finite when those are
    moved = node.op_type in LAYOUT and chain is None and all(
        _known_finite(v.a) for v in args if isinstance(v, Aff))
    for f in out:
        if f is None:
            continue
        if not (_finite(f.o) and _finite(f.b) and (moved or _known_finite(f.a)
                                                   or _finite(f.a))):
            raise NotAffine(f"{node.op_type} node {node.name}: a form overflowed")
        _note_finite(f.a)
    return out


# the coefficient arrays `step` found (or made from arrays it found) finite, by identity,
# held weakly: a form's arrays are never written in place, so an input's array passed on
# as an output (a form plus a constant keeps its coefficients; a layout op's views and
# gathers) is not summed again
_FINITE: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
_FINITE_LOCK = threading.Lock()  # the service walks in several threads at once


def _known_finite(v: np.ndarray) -> bool:
    if reference():
        return False
    with _FINITE_LOCK:
        return _FINITE.get(id(v)) is v


def _note_finite(v: np.ndarray) -> None:
    if not reference() and v.size >= _NOTE_MIN:
        with _FINITE_LOCK:
            _FINITE[id(v)] = v


# coefficient arrays below this many entries are summed again rather than held (a sum of
# them costs less than the bookkeeping)
_NOTE_MIN = 1 << 16


def _finite(v: np.ndarray) -> bool:
    """Whether every entry of v is finite: a finite sum says so in one pass without a
    temporary (an inf or nan entry makes the sum inf or nan); only a sum that is not
    finite (an overflow of finite entries, or one that is not) is checked entry by entry."""
    with np.errstate(over="ignore", invalid="ignore"):
        if not reference() and np.isfinite(np.sum(v)):
            return True
    return bool(np.all(np.isfinite(v)))


def _softmax_node(node: Node, x: Aff, c0: np.ndarray, m0: np.ndarray, ball: Ball,
                  rg: tuple[np.ndarray, np.ndarray] | None) -> Aff:
    ax = int(node.attrs.get("axis", -1))
    if x.masked is None:
        return _softmax_or_interval(x, ax, c0, m0, ball, rg)
    # an attention mask's entries: probability 0 (`_unmask`); the enclosure's ranges of the
    # masked logits (-inf) are not used
    p = _softmax_or_interval(_unmask(x, ax, ball), ax, c0, m0, ball, None)
    p.b = p.b + TINY
    p.m = p.m + TINY
    return p


def _step(node: Node, args: list, centers: list[np.ndarray | None], ball: Ball,
         ranges_of: Callable[[int], tuple[np.ndarray, np.ndarray] | None],
         chain: fused.Chain | None = None, consts: dict[str, float] | None = None) -> list:
    var = [i for i, v in enumerate(args) if isinstance(v, Aff)]
    t = node.op_type
    masks = _masks(node, args, var, centers, ball, chain)
    if masks is not None:
        return masks
    c0 = centers[0] if centers else None
    if chain is not None:
        assert consts is not None and c0 is not None
        rg = ranges_of(0)
        x = args[0]
        return [elementwise(x, chain_fn(chain, consts), ball, xlo=_lo(rg), xhi=_hi(rg),
                            out_c=c0, out_m=center_margin(c0))]
    if t == "Cast" and int(node.attrs.get("to", 0)) in FLOAT_TYPES or t in LAYOUT:
        return layout(node, args, centers, ball.size)
    if c0 is None:
        raise NotAffine(f"{t} node {node.name}: no centre")
    c0 = np.asarray(c0, dtype=np.float64)
    if not np.all(np.isfinite(c0)):  # masks (-inf): the enclosure's own rules handle them
        raise NotAffine(f"{t} node {node.name}: a centre value is not finite")
    m0 = center_margin(c0)
    if t in ("Mul", "MatMul") and len(var) == 2:
        return [product(args[0], args[1], ball, t == "MatMul", c0, m0)]
    if t == "Div" and 1 in var:
        return [_divide(args, var, c0, m0, ball, ranges_of(1))]
    if t in LINEAR:
        if t in ("Gemm", "Conv") and var != [0]:
            raise NotAffine(f"{t} node {node.name}: a variable weight or bias")
        return [linear(node, args, var, c0, m0, ball)]
    if t in SINGLE:
        ch = fused.Chain(node.inputs[0], node.outputs[0], [node])
        rg = ranges_of(0)
        return [elementwise(args[0], chain_fn(ch, {}), ball, xlo=_lo(rg), xhi=_hi(rg), out_c=c0,
                            out_m=m0)]
    if t == RELU_GRAD:
        return [_relu_grad(args, ball, ranges_of(1), c0, m0)]
    op = activation(t, node.attrs)
    if (op is not None or t in ARITHMETIC_TYPES) and var == [0]:
        fn = activation_fn(op, node.name) if op is not None else _power(node, args) \
            if t == "Pow" else relaxation_fn(_arithmetic(node), node.name)
        rg = ranges_of(0)
        return [elementwise(args[0], fn, ball, xlo=_lo(rg), xhi=_hi(rg), out_c=c0, out_m=m0)]
    if t == "Softmax" and var == [0]:
        return [_softmax_node(node, args[0], c0, m0, ball, ranges_of(0))]
    if t == "LayerNormalization" and var == [0]:
        return [_layernorm_node(node, args, c0, m0, ball, ranges_of(0))] + \
            [None] * (len(node.outputs) - 1)
    raise NotAffine(f"{t} node {node.name}: no affine rule")


def _relu_grad(args: list, ball: Ball, rg: tuple[np.ndarray, np.ndarray] | None,
               c0: np.ndarray, m0: np.ndarray) -> Aff:
    """g H(x) (internal_ops.RELU_GRAD) as the product of g's form and H's interval form: H
    is 1 where x's range is above 0, 0 where below, and moves within [0, 1] where the range
    reaches 0 (from H(x0), which is known where x's centre margin leaves out 0; else 1/2 +- 1/2
    at the centre and [-1, 1] for the change)."""
    g, x = args[0], args[1]
    if not isinstance(g, Aff) or not isinstance(x, Aff):
        raise NotAffine("ReluGrad of a constant")
    lo, hi = ranges(x, ball)
    if rg is not None:
        lo, hi = np.maximum(lo, rg[0]), np.minimum(hi, rg[1])
    free = ~((lo > 0) | (hi < 0))
    up, down = x.c - x.m > 0, x.c + x.m < 0
    known = up | down
    hc = np.where(known, np.where(up, 1.0, 0.0), 0.5)
    hm = np.where(known, 0.0, 0.5)
    # the change H(X) - H(X0): 0 where x's sign is fixed; [-1, 0] from H0 = 1, [0, 1] from
    # H0 = 0; [-1, 1] where H0 is not known
    ho = np.where(free & known, 0.5 - hc, 0.0)
    hb = np.where(free, np.where(known, 0.5, 1.0), 0.0)
    # the step's move a symbol per unit (not the box): the product's linear part keeps it,
    # so the units' moves stay shared by every entry the adjoint (tangent) spreads them to
    ha, hbox = fresh(np.zeros((*hc.shape, ball.size)), np.zeros_like(hb), hb)
    h = Aff(hc, hm, ho, ha, hbox)
    return product(g, h, ball, False, c0, m0)


def _layernorm_node(node: Node, args: list, c0: np.ndarray, m0: np.ndarray, ball: Ball,
                    rg: tuple[np.ndarray, np.ndarray] | None) -> Aff:
    if int(node.attrs.get("axis", -1)) % c0.ndim != c0.ndim - 1:
        raise NotAffine("LayerNorm over more than the last axis")
    gam = np.asarray(args[1], dtype=np.float64)
    beta = None if len(args) < 3 or args[2] is None else np.asarray(args[2], np.float64)
    try:
        return layernorm(args[0], gam, beta, decimal_attr(float(node.attrs.get(
            "epsilon", 1e-5))), c0, ball, _lo(rg), _hi(rg))
    except NotAffine:  # |y - beta| <= |gamma| sqrt(D - 1)
        bnd = np.abs(gam) * math.sqrt(c0.shape[-1] - 1) * (1 + 1e-12)
        bb = np.zeros_like(c0) if beta is None else np.broadcast_to(beta, c0.shape)
        return interval(c0, m0, bb - bnd, bb + bnd, ball.size)


def uses(nodes: list[Node], chains: dict[str, fused.Chain], inside: set[str]
         ) -> dict[str, int]:
    """How many steps read each tensor (a chain's root is read once, at its sink): a form
    is dropped after its last reader (`release`), so only live forms are held."""
    out: dict[str, int] = {}
    for node in nodes:
        if node.name in inside:
            chain = chains.get(node.name)
            names = [chain.root] if chain is not None else []
        else:
            names = [i for i in node.inputs if i]
        for i in names:
            out[i] = out.get(i, 0) + 1
    return out


def release(forms: dict[str, Aff], count: dict[str, int], names: list[str],
            keep: str) -> None:
    for i in names:
        if i and i in count:
            count[i] -= 1
            if count[i] <= 0 and i != keep:
                forms.pop(i, None)


def walk(nodes: list[Node], input_name: str, env: dict[str, torch.Tensor], ball: Ball,
         chains: dict[str, fused.Chain], inside: set[str], keep: str | None = None,
         everything: bool = True, seeds: dict[str, Aff] | None = None,
         symbols: int = 0, known: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
         hook: Callable[[Node, dict[str, Aff]], None] | None = None,
         capture: dict[str, Aff | None] | None = None,
         space: list[int] | None = None, quad: bool = False) -> dict[str, Aff]:
    """The forms of every input-dependent tensor, alone (no Jacobian enclosure): an op with
    no rule gives its outputs the interval form of... nothing known, so the walk stops there
    and the tensors after it are missing. `seeds`: more graph inputs given as forms, over the
    first `symbols` noise symbols (derived/tangent.py: the tangent's direction); `known`: ranges
    some tensors are known to lie in (a mean of squares plus eps is at least eps), which `hook`
    (called before every node with the live forms) may add to; `capture`: names whose forms are kept
    there when made (whatever is released later); `space`: receives the symbols used, [P, used,
    reserved] (a later walk over the same symbols passes `symbols=used`); `quad`: the products'
    quadratic parts on second-order symbols (affine.QUAD, reserved after the first `symbols`)."""
    forms: dict[str, Aff] = {input_name: input_form(ball)}
    forms.update(seeds or {})
    count = None if everything else uses(nodes, chains, inside)
    reserved = symbols + (quad_size(ball.size) if quad else 0)
    token = SPACE.set([ball.size, reserved, reserved])  # the seeds' symbols: not budgeted
    token_q = QUAD.set(ball.size + symbols if quad else None)
    try:
        _walk(nodes, forms, env, ball, chains, inside, count, keep or "",
              {} if known is None else known, hook, capture)
    finally:
        if space is not None:
            space[:] = list(SPACE.get() or [])
        QUAD.reset(token_q)
        SPACE.reset(token)
    return forms


def _walk(nodes: list[Node], forms: dict[str, Aff], env: dict[str, torch.Tensor], ball: Ball,
          chains: dict[str, fused.Chain], inside: set[str], count: dict[str, int] | None,
          keep: str, known: dict[str, tuple[np.ndarray, np.ndarray]],
          hook: Callable[[Node, dict[str, Aff]], None] | None = None,
          capture: dict[str, Aff | None] | None = None) -> None:
    # a square read only by a sum over the last axis: both as one rule (distances.py); the
    # sum's node then finds no form to read and is passed
    squares = square_sums(nodes, env, keep)
    for node in nodes:
        if node.name in inside and node.name not in chains:
            continue
        chain = chains.get(node.name)
        ins = [chain.root] if chain is not None else node.inputs
        if node.op_type in ("Shape", "Size") or not any(i in forms for i in ins if i):
            continue
        if hook is not None:
            hook(node, forms)
        args = [None if not i else forms[i] if i in forms else
                (env[i].detach().numpy() if i in env else None) for i in ins]
        outs = [chain.sink] if chain is not None else node.outputs
        centers = [None if not o or o not in env else env[o].detach().numpy() for o in outs]
        # a masked difference (an attention mask's entries) takes the node's own rules
        first = args[0]
        total = squares.get(node.name) if isinstance(first, Aff) and first.masked is None \
            else None
        try:
            if total is not None and isinstance(first, Aff):
                outs, res = total.outputs, [square_sum_step(total, first, env, ball)]
            else:
                res = step(node, args, centers, ball, _known_of(known, ins), chain,
                           fused_consts(chain, env) if chain is not None else None)
        except NotAffine:
            return
        for o, v in zip(outs, res, strict=False):
            if o and v is not None:
                forms[o] = v
                if capture is not None and o in capture:
                    capture[o] = v
        if count is not None:
            release(forms, count, ins, keep)


def _known_of(known: dict[str, tuple[np.ndarray, np.ndarray]], ins: list[str]
              ) -> Callable[[int], tuple[np.ndarray, np.ndarray] | None]:
    return lambda i: known.get(ins[i]) if i < len(ins) else None


def fused_consts(chain: fused.Chain, env: dict[str, torch.Tensor]) -> dict[str, float]:
    inner = {n.outputs[0] for n in chain.nodes}
    return {i: float(env[i].reshape(())) for nd in chain.nodes for i in nd.inputs
            if i and i in env and env[i].numel() == 1 and i != chain.root and i not in inner}


# the rules' entry points, for the walks and tests that reach them through this module
__all__ = ["EXP", "FLOAT_TYPES", "LAYOUT", "LINEAR", "RECIPROCAL", "RELU", "RSQRT", "SINGLE",
           "SQRT", "SQUARE", "Fn", "NotAffine", "_weighted_cols", "activation_fn", "chain_fn",
           "elementwise", "fused_consts", "layernorm", "layout", "linear", "norm_parts",
           "product", "relaxation_fn", "release", "softmax", "step", "uses", "variance",
           "walk", "weighted_sum"]
