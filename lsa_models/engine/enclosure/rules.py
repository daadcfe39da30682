"""Local rules, one class per ONNX op family, in a registry (auto_LiRPA's split: the ball is
the perturbation, these are the per-op bound classes, drivers/jacobian.py is the graph driver).

A rule gets the node, its arguments (`LocalValue` for input-dependent tensors, float64 arrays
for constants), the centre values of its outputs (the float64 forward pass at X0) and the
ball, and returns one `LocalValue` (or constant array) per output.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import numpy as np
import torch
from torch.func import vmap

from lsa_models.bounds.numerics import U
from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.enclosure.layernorm import _bounds_of_s as bounds_of_s
from lsa_models.engine.enclosure.layernorm import chain_errors, token_radius
from lsa_models.engine.enclosure.layernorm import direct as ln_direct
from lsa_models.engine.remainders.operator_norms import blockwise as op_blockwise
from lsa_models.engine.remainders.operator_norms import nonneg_block_norms
from lsa_models.engine.values import (
    Ball,
    LocalNotCertified,
    LocalValue,
    OpRemainder,
    Parts,
    center_margin,
    enclose,
    widen_up,
)
from lsa_models.engine.values import gamma as gamma_k
from lsa_models.onnx.ops import FLOAT_TYPES, OPS, Node, RunContext, decimal_attr
from lsa_models.operators import ACTIVATION_TYPES, ARITHMETIC_TYPES, make

Arg = LocalValue | np.ndarray | None
CTX = RunContext(torch.float64)


class LocalRule:
    types: ClassVar[tuple[str, ...]] = ()

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> list[LocalValue | np.ndarray | None]:
        raise NotImplementedError


LOCAL_RULES: dict[str, LocalRule] = {}


def register_local(cls: type[LocalRule]) -> type[LocalRule]:
    inst = cls()
    for t in cls.types:
        LOCAL_RULES[t] = inst
    return cls


def _torch(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, order="C"))  # a writable copy (torch needs one)


def _variables(args: list[Arg]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, LocalValue)]


@register_local
class LayoutRule(LocalRule):
    """Ops that only move, copy or drop entries: run the op on index codes to learn where
    every output entry comes from; Jacobian rows and ranges are gathered (exact)."""

    types = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice",
             "Gather", "Concat", "Split", "Expand", "Dropout", "Cast", "Tile")

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> list[LocalValue | np.ndarray | None]:
        if node.op_type == "Cast" and int(node.attrs.get("to", 0)) not in FLOAT_TYPES:
            raise LocalNotCertified(f"Cast node {node.name} turns an input-dependent tensor "
                                    "into a non-float one")
        ins: list[torch.Tensor | None] = []
        rows_c, rows_r, lo, hi = [np.zeros((1, ball.size))], [np.zeros((1, ball.size))], \
            [np.zeros(1)], [np.zeros(1)]
        offset = 1
        for a in args:
            if isinstance(a, LocalValue):
                n = a.center.size
                ins.append(_torch(np.arange(offset, offset + n, dtype=np.float64)
                                  .reshape(a.shape)))
                rows_c.append(a.jc.reshape(n, -1))
                rows_r.append(a.jr.reshape(n, -1))
                lo.append(a.lo.reshape(-1))
                hi.append(a.hi.reshape(-1))
                offset += n
            elif a is None:
                ins.append(None)
            elif np.issubdtype(a.dtype, np.floating):
                ins.append(_torch(np.zeros_like(a, dtype=np.float64)))  # code 0: constant
            else:
                ins.append(_torch(a))
        codes = OPS[node.op_type].run(node, ins, CTX)
        var = [a for a in args if isinstance(a, LocalValue)]
        fac = var[0].jfac if len(var) == 1 else None
        jc_all, jr_all = np.concatenate(rows_c), np.concatenate(rows_r)
        lo_all, hi_all = np.concatenate(lo), np.concatenate(hi)
        out: list[LocalValue | np.ndarray | None] = []
        for code, center in zip(codes, centers, strict=False):
            if center is None or not code.is_floating_point():
                out.append(center)
                continue
            idx = code.numpy().astype(np.int64)  # (*S_out,)
            live = idx > 0
            c = np.asarray(center, dtype=np.float64)
            v = LocalValue(c, np.where(live, lo_all[idx], c), np.where(live, hi_all[idx], c),
                           jc_all[idx], jr_all[idx])
            if fac is not None and ball.norm == "inf":  # rows of one input (code 0: none)
                m, dmb, jsrc, rest = fac
                b, p = m.shape[-1], rest.shape[-1]
                mz = np.concatenate([np.zeros((1, b)), m.reshape(-1, b)])
                rz = np.concatenate([np.zeros((1, p)), rest.reshape(-1, p)])
                v.jfac = (mz[idx], dmb, jsrc, rz[idx])
            out.append(v)
        return out


def _abs_node(node: Node) -> Node:
    """The node computing |L| of a linear op L: Sub adds, Neg is the identity, alpha > 0."""
    n = copy.copy(node)
    n.attrs = dict(node.attrs)
    if node.op_type == "Sub":
        n.op_type = "Add"
    if node.op_type == "Neg":
        n.op_type = "Identity"
    if "alpha" in n.attrs:
        n.attrs["alpha"] = abs(float(n.attrs["alpha"]))
    return n


@register_local
class LinearRule(LocalRule):
    """Ops linear in their input-dependent operands (Add/Sub/Neg, Mul/Div/MatMul/Gemm by a
    constant, ReduceMean/ReduceSum): the tangents go through the op itself (vmap over the
    input's P directions), the radii through |L|."""

    types = ("Add", "Sub", "Neg", "Mul", "Div", "MatMul", "Gemm", "ReduceMean", "ReduceSum")

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> list[LocalValue | np.ndarray | None]:
        t = node.op_type
        var = _variables(args)
        if t in ("Mul", "MatMul") and len(var) == 2:
            c = centers[0]
            assert c is not None
            return [pr.product(args[0], args[1], c, ball, t == "MatMul")]  # type: ignore[arg-type]
        if t == "Div" and 1 in var:
            return [_divide(node, args, centers, ball)]
        if t == "Gemm" and var != [0]:
            raise LocalNotCertified(f"Gemm node {node.name}: only input @ constant")

        def consts(absolute: bool) -> list[torch.Tensor | None]:
            return linear_consts(node, args, absolute, LocalValue)

        def run(nd: Node, fixed: list[torch.Tensor | None], tangents: list[np.ndarray]
                ) -> np.ndarray:
            return run_tangents(nd, fixed, var, tangents)

        vals = [args[i] for i in var]
        assert all(isinstance(v, LocalValue) for v in vals)
        jc = run(node, consts(False), [v.jc for v in vals])  # type: ignore[union-attr]
        absn = _abs_node(node)
        jr_abs = run(absn, consts(True), [v.jr for v in vals])  # type: ignore[union-attr]
        jc_abs = run(absn, consts(True), [np.abs(v.jc) for v in vals])  # type: ignore[union-attr]
        k = max(int(np.prod(a.shape)) if a is not None else 1 for a in args)
        c = centers[0]
        assert c is not None
        # interval form: |y(X) - y_c| <= |L|(rad_in) + the centre's margin (docs, "Values")
        fixed = consts(True)
        for i, v in zip(var, vals, strict=True):
            fixed[i] = _torch(v.rad)  # type: ignore[union-attr]
        spread = OPS[absn.op_type].run(absn, fixed, CTX)[0].numpy()
        rad = widen_up(np.broadcast_to(spread, c.shape), k) + center_margin(c)
        out = pr.linear(c, jc, jr_abs, jc_abs, k, ball, c - rad, c + rad)
        src = vals[0].jfac if len(vals) == 1 else None  # type: ignore[union-attr]
        if src is not None and ball.norm == "inf":
            # J_out(X) - jc_out = L(M) delta src + L(R) + (L jc - fl(L jc)); fl(L M) is within
            # gamma_k |L| |M| of L M, which the rest takes times dmb |src|
            m, dmb, jsrc, rest = src
            lm = run(node, consts(False), [m])
            lam = run(absn, consts(True), [np.abs(m)])
            lrest = run(absn, consts(True), [rest])
            b = m.shape[-1]
            err = (lam.reshape(-1, b) * dmb) @ np.abs(jsrc)
            out.jfac = (lm, dmb, jsrc, widen_up(
                lrest + gamma_k(k) * jc_abs + gamma_k(k) * err.reshape(lrest.shape), k + b))
        return [out]


def linear_consts(node: Node, args: list, absolute: bool, variable: type
                  ) -> list[torch.Tensor | None]:
    """The fixed operands of a linear op run on changes or tangents (shared with the affine
    rules): None at the input-dependent ones (instances of `variable`), constant addends
    zeroed (Add/Sub, Gemm's C, Conv's bias: they cancel in differences), float constants in
    float64, their absolute values with `absolute` (the op |L|)."""
    t = node.op_type
    additive = t in ("Add", "Sub", "Gemm", "Conv")
    out: list[torch.Tensor | None] = []
    for i, a in enumerate(args):
        if a is None or isinstance(a, variable):
            out.append(None)
        elif not np.issubdtype(a.dtype, np.floating):
            out.append(_torch(a))
        elif additive and (t not in ("Gemm", "Conv") or i == 2):
            out.append(_torch(np.zeros_like(a, dtype=np.float64)))
        else:
            out.append(_torch((np.abs(a) if absolute else a).astype(np.float64)))
    return out


def run_tangents(nd: Node, fixed: list[torch.Tensor | None], var: list[int],
                 xs: list[np.ndarray]) -> np.ndarray:
    """The op with the operands `var` replaced by xs (..., P), vectorised over the last axis
    (vmap): a linear op applied to P tangents or coefficient columns at once. A MatMul by a
    constant matrix goes to one BLAS product directly (vmap's batched form was 4x slower on
    the wide affine forms; any summation order is covered by the rules' rounding terms)."""
    fast = _matmul_tangents(nd, fixed, var, xs)
    if fast is not None:
        return fast

    def f(*ts: torch.Tensor) -> torch.Tensor:
        ins = list(fixed)
        for i, tt in zip(var, ts, strict=True):
            ins[i] = tt
        return OPS[nd.op_type].run(nd, ins, CTX)[0]
    return vmap(f, in_dims=-1, out_dims=-1)(*[_torch(x) for x in xs]).numpy()


def _matmul_tangents(nd: Node, fixed: list[torch.Tensor | None], var: list[int],
                     xs: list[np.ndarray]) -> np.ndarray | None:
    """run_tangents of a MatMul with one constant 2-D operand, or None: X W has the tangents
    (..., n, k, P) -> W^T (k -> m) per (..., n), i.e. np.matmul(W^T, x); C X has
    (..., n, k, P) -> C over n, i.e. C @ x with k and P flattened."""
    if nd.op_type != "MatMul" or len(var) != 1 or len(xs) != 1:
        return None
    x = np.asarray(xs[0], dtype=np.float64)
    other = fixed[1 - var[0]]
    if other is None or other.dim() != 2 or other.dtype != torch.float64:
        return None
    w = other.detach().numpy()
    if var[0] == 0:  # X @ W
        if x.ndim < 2 or x.shape[-2] != w.shape[0]:
            return None
        return np.matmul(w.T, x)
    # C @ X
    if x.ndim == 2:  # X a vector (n,): its tangents (n, P)
        return w @ x if x.shape[0] == w.shape[1] else None
    if x.ndim < 3 or x.shape[-3] != w.shape[1]:
        return None
    flat = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    return np.matmul(w, flat).reshape(*x.shape[:-3], w.shape[0], x.shape[-2], x.shape[-1])


def _divide(node: Node, args: list[Arg], centers: list[np.ndarray | None],
            ball: Ball) -> LocalValue:
    """a / b with b input-dependent: a * (1/b), the reciprocal's derivative range from b's."""
    b = args[1]
    assert isinstance(b, LocalValue)
    inv = pr.elementwise(b, "reciprocal", 1.0 / b.center, ball)
    c = centers[0]
    assert c is not None
    a = args[0]
    assert a is not None
    out = pr.product(a, inv, c, ball, matmul=False)
    prod_term, inv_term = out.term, inv.term
    assert prod_term is not None and inv_term is not None
    ac = a.center if isinstance(a, LocalValue) else np.asarray(a, dtype=np.float64)

    prod_parts, inv_parts = out.parts, inv.parts
    assert prod_parts is not None and inv_parts is not None

    def term(g: np.ndarray) -> np.ndarray:
        # the adjoint of 1/b is G * a at the centre summed over the broadcast axes; g = |G|, so
        # the sum of |G| |a| bounds its absolute value
        return prod_term(g) + inv_term(_unbroadcast(g * np.abs(ac), inv.shape))

    def parts(g: np.ndarray) -> list[Parts]:
        return prod_parts(g) + inv_parts(_unbroadcast(g * np.abs(ac), inv.shape))
    # a new term: the product's opnorm and second-order rules bound the product's alone
    out.remainder = OpRemainder(term, parts)
    return out


def _unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a (K, *S_out) adjoint down to (K, *shape) (numpy broadcasting reversed)."""
    extra = g.ndim - 1 - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(1, 1 + extra)))
    axes = tuple(i + 1 for i, d in enumerate(shape) if d == 1 and g.shape[i + 1] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


@register_local
class ElementwiseRule(LocalRule):
    """Pointwise nonlinearities: slopes over the input's range (primitives.elementwise); the
    activations' from lsa_models/operators/. Gelu is rules_more.GeluRule's (its tanh form as
    a chain, the exact one by this rule)."""

    types = tuple(t for t in ACTIVATION_TYPES if t != "Gelu") + ARITHMETIC_TYPES

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> list[LocalValue | np.ndarray | None]:
        x = args[0]
        c = centers[0]
        if not isinstance(x, LocalValue) or c is None:
            raise LocalNotCertified(f"{node.op_type} node {node.name}: input-dependent "
                                    "exponent")
        attrs = node.attrs
        if node.op_type == "Pow":
            e = args[1]
            if not isinstance(e, np.ndarray) or e.size != 1:
                raise LocalNotCertified(f"Pow node {node.name}: the exponent must be one "
                                        "constant")
            attrs = {"exponent": float(e.reshape(()))}
        kind = make(node.op_type, attrs)
        assert kind is not None
        try:
            return [pr.elementwise(x, kind, c, ball)]
        except LocalNotCertified as e:
            raise LocalNotCertified(f"{node.op_type} node {node.name}: {e}") from None


@register_local
class SoftmaxRule(LocalRule):
    types = ("Softmax",)

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> list[LocalValue | np.ndarray | None]:
        x, c = args[0], centers[0]
        assert isinstance(x, LocalValue) and c is not None
        return [pr.softmax(x, int(node.attrs.get("axis", -1)), c, ball)]


def layernorm(x: LocalValue, gamma: np.ndarray, beta: np.ndarray | None, eps: float,
              out_center: np.ndarray, ball: Ball) -> LocalValue:
    """LayerNorm over the last axis, as its chain u = P x, s = mean(u^2), r = (s + eps)^-1/2,
    y = gamma u r + beta; every link enclosed over the ball (docs/local-enclosure.md)."""
    d = x.shape[-1]
    jm = x.jc.mean(axis=-2, keepdims=True)  # (..., 1, P)
    uc = x.center - x.center.mean(axis=-1, keepdims=True)
    sqc = uc * uc
    sc = sqc.mean(axis=-1, keepdims=True) + eps
    rc = 1.0 / np.sqrt(sc)
    zc = uc * rc
    chain_errors(x, uc, sqc, sc, rc, zc, eps)  # the chain's own centres' proven errors
    u = pr.linear(uc, x.jc - jm, x.jr + x.jr.mean(axis=-2, keepdims=True),
                  np.abs(x.jc) + np.abs(x.jc).mean(axis=-2, keepdims=True), d, ball)
    sq = pr.elementwise(u, "pow", sqc, ball)
    # ||P x|| is within ||P x0|| +- rho, rho >= ||x - x0|| per token (P is a projection):
    # s = ||P x||^2 / D + eps lies in [(||P x0|| - rho)_+^2 / D + eps, (||P x0|| + rho)^2 / D + eps]
    norm0 = np.sqrt(np.square(uc).sum(axis=-1, keepdims=True))
    rho = np.sqrt(np.square(x.rad).sum(axis=-1, keepdims=True))
    # or from the Jacobian enclosures of x and of u = P x (layernorm.token_radius): a 2-ball
    # moves a token by far less than its entrywise box says
    rho = np.minimum(rho, np.minimum(token_radius(x, ball), token_radius(u, ball)))
    if x.tok_rad is not None:  # telescoped in the operator norm (Telescope.tighten)
        rho = np.minimum(rho, x.tok_rad)
    slack = 1e-12 * (norm0 * norm0 / d + eps)  # rounding of these few float64 operations
    s_lo = np.maximum(norm0 - rho, 0.0) ** 2 / d + eps - slack
    s_hi = (norm0 + rho) ** 2 / d + eps + slack
    s = pr.linear(sc, sq.jc.mean(axis=-2, keepdims=True), sq.jr.mean(axis=-2, keepdims=True),
                  np.abs(sq.jc).mean(axis=-2, keepdims=True), d, ball,
                  lo=np.maximum(s_lo, eps * (1 - 1e-12)), hi=s_hi)
    r = pr.elementwise(s, "pow", rc, ball, exponent=-0.5)
    z = pr.product(u, r, zc, ball, matmul=False)
    g = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (d,))
    ag = np.abs(g)[:, None]
    chain = pr.linear(out_center, z.jc * g[:, None], z.jr * ag, np.abs(z.jc) * ag, 2, ball)
    # the direct enclosure of S = dz/dx (enclosure/layernorm.py); both hold, so the entrywise
    # smaller (the chain's radius moved to the direct centre by |jc_chain - jc_direct|)
    jc, jr_d, y_lo, y_hi, _, sr, sr0 = ln_direct(x, u, g, beta, eps, norm0, rho)
    jr_c = widen_up(chain.jr + np.abs(chain.jc - jc), 2)
    # per token ||z(X) - z(X0)||_2 <= w_hi R (ln_block_norms), so every entry of y moves by at
    # most |gamma_i| w_hi R from y(X0), which is within the centre's margin of out_center
    zrad = ln_block_norms(u, norm0, rho, d, eps, z_radius=True)[..., None]  # (..., 1)
    yrad = widen_up(np.abs(g) * zrad + center_margin(out_center), 4)
    y_lo = np.maximum(y_lo, out_center - yrad)
    y_hi = np.minimum(y_hi, out_center + yrad)
    out = enclose(out_center, jc, np.minimum(jr_d, jr_c), ball, y_lo, y_hi)
    sq_t, r_t, z_t = sq.term, r.term, z.term
    assert sq_t is not None and r_t is not None and z_t is not None
    rs = -0.5 * np.power(s.center, -1.5)  # dr/ds at the centre
    upstream = np.abs(x.jc) + x.jr  # (..., D, P)
    srs = sr + sr0  # (..., D, D): rows are the output's entries

    def term(gy: np.ndarray) -> np.ndarray:
        # bounds on the adjoints of the chain's links at the centre, from the output's: each
        # link's term takes a nonnegative bound on its adjoint, so the signed factors (gamma,
        # u0, dr/ds) enter with their absolute values (with signs, sum |G| gamma u0 cancels
        # and the remainder came out too small: tests/test_local_rules_more.py, corners)
        gz = np.abs(gy) * np.abs(g)  # (K, ..., D)
        gr = (gz * np.abs(uc)).sum(axis=-1, keepdims=True)  # (K, ..., 1)
        gsq = np.broadcast_to(gr * np.abs(rs) / d, gz.shape)
        via_chain = z_t(gz) + r_t(gr) + sq_t(gsq)
        # directly: sum_i |G_i| |gamma_i| (sr + sr0)_ij |J_x(X)|_j
        k = gy.shape[0]
        h = (np.abs(gz)[..., None, :] @ srs)[..., 0, :]  # (K, ..., D)
        via_s = h.reshape(k, -1) @ upstream.reshape(-1, upstream.shape[-1])
        return np.minimum(via_chain, via_s * (1 + gamma_k(2 * d)))

    def parts(gy: np.ndarray) -> list[Parts]:  # the direct form: c = |G gamma| (sr + sr0)
        k, p = gy.shape[0], x.jc.shape[-1]
        h = (np.abs(gy * g)[..., None, :] @ srs)[..., 0, :] * (1 + gamma_k(2 * d))
        return [(h.reshape(k, -1), x.jc.reshape(-1, p), x.jr.reshape(-1, p))]
    op = None
    if ball.norm == "2":
        block = np.minimum(ln_block_norms(u, norm0, rho, d, eps),
                           nonneg_block_norms(srs)) * (1 + 4 * U)
        op = op_blockwise(float(block.max()), x.jc, x.jr, g, x.jnorm, blocks=block)
    out.remainder = OpRemainder(term, parts, op)
    return out


def ln_block_norms(u: LocalValue, norm0: np.ndarray, rho: np.ndarray, d: int, eps: float,
                   z_radius: bool = False) -> np.ndarray:
    """Per token, a bound on ||S(X) - S(X0)||_2 for S = w (P - z z^T / D), w = 1/sigma
    (docs/local-second-order.md, "Operator-norm telescoping"): with R = rho + rho0 >= ||u(X) -
    u(X0)|| (rho: the token's radius around the computed centre, rho0: the centre's margin),
    w(X), w(X0) in [w_lo, w_hi] (sigma from ||u|| in ||u_c|| +- R),
    S(X) - S(X0) = (w - w0)(P - z z^T / D) + w0 (z0 z0^T - z z^T) / D, ||P - z z^T/D||_2 <= 1,
    ||z||, ||z0|| < sqrt(D), and ||z - z0|| <= R w_hi: dz/du = w (I - z z^T / D) on
    range(P) has norm <= w, and the segment from u(X0) to u(X) stays where w <= w_hi (mean
    value theorem), so ||S(X) - S(X0)||_2 <= dw + 2 w_hi ||z - z0|| / sqrt(D).
    With `z_radius`: that bound on ||z(X) - z(X0)||_2 per token instead."""
    mu = center_margin(u.center)
    rho0 = np.sqrt(widen_up(np.square(mu).sum(axis=-1, keepdims=True), d)) * (1 + 4 * U)
    r = widen_up(rho + rho0, 2)
    s_lo, s_hi = bounds_of_s(norm0, r, d, eps)
    w_lo = 1.0 / np.sqrt(s_hi) * (1 - 1e-12)
    w_hi = 1.0 / np.sqrt(s_lo) * (1 + 1e-12)
    dw = (w_hi - w_lo) * (1 + 1e-12)
    dz = widen_up(r * w_hi, 2)
    if z_radius:
        return dz[..., 0]
    block = widen_up(dw + 2 * w_hi * dz / np.sqrt(d), 4) * (1 + 1e-12)
    return np.minimum(block, ln_derivative_block(r, s_lo, s_hi, d, eps))[..., 0]


def ln_derivative_block(r: np.ndarray, s_lo: np.ndarray, s_hi: np.ndarray, d: int,
                        eps: float) -> np.ndarray:
    """||S(u) - S(u0)||_2 <= R sup ||DS||, the sup over the ball ||u - u0|| <= R (in range(P))
    where sigma^2 = s lies in [s_lo, s_hi] (docs/local-second-order.md, "LayerNorm's Jacobian change
    by its derivative"): with n = ||u||, z = u w, zeta = ||z||, kappa = 1 - zeta^2 / D = eps w^2,
    and du = alpha zhat + beta t (t a unit vector orthogonal to z in range(P)),
      DS[du] = -(w^2 zeta / D) ([[alpha, beta], [beta, 3 kappa alpha]] on span(t, zhat),
                                alpha I on the rest of range(P), 0 on the constants),
    whose largest |eigenvalue| over alpha^2 + beta^2 = 1 is F(kappa) = 2 / sqrt(3 (1 - kappa))
    (kappa <= 2/3) or 3 kappa; w^2 zeta / D = sqrt((s - eps) / D) / s^1.5 peaks at s = 1.5 eps
    (increasing below, decreasing above), F increases with kappa <= eps / s_lo."""
    s_star = np.clip(1.5 * eps, s_lo, s_hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        # s_lo = 0 only for eps = 0 with a token ball reaching the constants: no bound
        h = np.where(s_star > 0, np.sqrt(np.maximum(s_star - eps, 0.0) / d)
                     / np.maximum(s_star, 1e-300) ** 1.5, np.inf)
        kappa = np.where(s_lo > 0, np.minimum(eps / np.maximum(s_lo, 1e-300) * (1 + 1e-12),
                                              1.0), 1.0)
    f = np.where(kappa <= 2.0 / 3.0, 2.0 / np.sqrt(3.0 * np.maximum(1.0 - kappa, 1e-300)),
                 3.0 * kappa)
    return widen_up(r * h * f, 8)


@register_local
class LayerNormRule(LocalRule):
    types = ("LayerNormalization",)

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> list[LocalValue | np.ndarray | None]:
        x, gamma = args[0], args[1]
        beta = args[2] if len(args) > 2 else None
        c = centers[0]
        if not isinstance(x, LocalValue) or not isinstance(gamma, np.ndarray) \
                or isinstance(beta, LocalValue) or c is None:
            raise LocalNotCertified(f"LayerNormalization node {node.name}: scale and bias "
                                    "must be constants")
        if int(node.attrs.get("axis", -1)) % len(x.shape) != len(x.shape) - 1:
            raise LocalNotCertified(f"LayerNormalization node {node.name} normalises over "
                                    "more than the last axis")
        eps = decimal_attr(float(node.attrs.get("epsilon", 1e-5)))
        return [layernorm(x, gamma, beta, eps, c, ball)] + [None] * (len(node.outputs) - 1)


def exact(center: np.ndarray, ball: Ball) -> LocalValue:
    """A tensor known to equal its centre everywhere on the ball (zero Jacobian)."""
    z = np.zeros((*center.shape, ball.size))
    return enclose(center, z, z, ball)
