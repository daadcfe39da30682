"""Rotary position embeddings read from a graph (docs/bounds.md, "Rotary position embeddings").

A query (or key) tensor that is not the same affine map of the layer input at every position
may be a position-independent projection u (`u_i = x_i W + b`) followed by a per-position
linear map `t_i = u_i M_i`: rotary embeddings (LLaMA, Qwen, GPT-NeoX: `u cos + rotate_half(u)
sin` with constant Cos/Sin tables) make `M_i` a rotation. Found by meaning: among the
position-independent affine tensors the query depends on, the nearest whose closed region to
the query is per-position linear (read with d basis inputs of u, exact in float64, and
confirmed at a random u); the rotation is verified (`||M_i^T M_i - I|| <= 2^-20`), and a
certified `rho >= max_i ||M_i||_2` (slightly above 1: the tables are float32 numbers) enters
the bound as a factor of the logit scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from ..bounds.numerics import U, add_up, mul_up, sqrt_up
from .attention_probe import TOL, NotAttention, Probe, token_view
from .graph import GraphInfo
from .ops import Node

ROTATION_TOL = 2.0 ** -20  # ||M_i^T M_i - I||_F of a rotation whose table is float32
ROTARY_NOTE = ("rotary position embeddings read as per-position rotations R_i of the query/key "
               "projections (||R_i^T R_i - I|| <= 2^-20); the bound uses certified "
               "max_i ||R_i||_2 of the tables as given")


def rotation_norm_upper(m: np.ndarray) -> tuple[float, float]:
    """(rho, e): a certified upper bound rho on `max_b ||m[b]||_2` for square float64
    matrices m (B, w, w), and e = max_b ||fl(m[b]^T m[b]) - I||_F (how far from orthogonal).

    `||M||_2^2 = ||M^T M||_2 <= 1 + ||M^T M - I||_F`. Computed: `fl(M^T M)` is within
    `gamma_w ||M||_F^2` of `M^T M` (Frobenius), and the Frobenius norm of `fl(fl(M^T M) - I)`
    is inflated by `(1 + 2 (w^2 + 2) u)` for the subtraction, the squares and their sum."""
    b, w, _ = m.shape
    gram = np.swapaxes(m, 1, 2) @ m  # (B, w, w)
    e_fro = np.sqrt(np.square(gram - np.eye(w)).sum(axis=(1, 2)))  # (B,)
    m_fro_sq = np.square(m).sum(axis=(1, 2))  # (B,)
    gamma = (w * U) / (1.0 - w * U)
    sum_rel = 1.0 + 2.0 * (w * w + 2) * U
    e_up = mul_up(float(e_fro.max()), sum_rel)
    form_up = mul_up(gamma, float(m_fro_sq.max()), sum_rel)
    return sqrt_up(add_up(1.0, e_up, form_up)), float(e_fro.max())


def _per_position_map(info: GraphInfo, sub: list[Node], u: str, tr_u: bool, t: str, tr_t: bool,
                      n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(M (Gt, N, w, w), parent (Gt,)) with `view(t)[g, i] = view(u)[parent[g], i] M[g, i]`
    on the closed region `sub` from u to t, or None. Each t group reads one u group (the same
    one, or a shared key/value head repeated for grouped-query attention): found with one
    random u group at a time. Basis inputs (every row of u set to e_k) then read M exactly; a
    random u confirms the map keeps groups and positions apart and has no constant part."""
    shape_u = info.shape(u)
    gu, _, w = token_view(info.env[u], n, tr_u).shape
    gen = np.random.default_rng(11)

    def run(v: np.ndarray) -> np.ndarray:  # v: (Gu, N, w) view of u
        a = np.swapaxes(v, -1, -2) if tr_u else v
        x = torch.from_numpy(np.ascontiguousarray(a).reshape(shape_u))
        with torch.no_grad():
            out = info.eval_nodes(sub, {u: x})[t]
        return token_view(out, n, tr_t)

    zero = run(np.zeros((gu, n, w)))
    gt = zero.shape[0]
    if zero.shape != (gt, n, w) or gt % gu or np.abs(zero).max() > 0:
        return None  # a per-position constant would need its own norm in the bound
    reads = np.zeros((gt, gu), dtype=bool)
    for g in range(gu):
        one = np.zeros((gu, n, w))
        one[g] = gen.standard_normal((n, w))
        reads[:, g] = np.abs(run(one)).reshape(gt, -1).max(axis=1) > 0
    if not (reads.sum(axis=1) == 1).all():
        return None
    parent = reads.argmax(axis=1)  # (Gt,)
    m = np.empty((gt, n, w, w))
    for k in range(w):
        basis = np.zeros((gu, n, w))
        basis[..., k] = 1.0
        m[:, :, k, :] = run(basis)
    probe = gen.standard_normal((gu, n, w))
    got = run(probe)
    pred = np.einsum("gik,gikl->gil", probe[parent], m)  # (Gt, N, w)
    if not np.abs(pred - got).max() <= TOL * (1.0 + np.abs(pred).max()):
        return None
    return m, parent


def unrotate(info: GraphInfo, nodes: list[Node], aff: set[str], probe: Probe,
             envs: Sequence[Mapping[str, Tensor]], xs: list[np.ndarray],
             target: tuple[str, bool]) -> tuple[tuple[np.ndarray, np.ndarray], float]:
    """For a query/key tensor `target` that is position-dependent: the position-independent
    projection (W (G, D, w), b (G, w)) it rotates and the certified `rho >= max_i ||M_i||_2`.
    Raises NotAttention (naming the tensor) when no such factorisation exists."""
    name, tr = target
    n = probe.n
    shape_t = token_view(info.env[name], n, tr).shape
    by_out = {o: nd for nd in nodes for o in nd.outputs if o}
    anc: list[str] = []
    stack = [name]
    while stack:
        t0 = stack.pop()
        nd = by_out.get(t0)
        if nd is None:
            continue
        for i in nd.inputs:
            if i in aff and i not in anc and i != probe.source:
                anc.append(i)
                stack.append(i)
    # nearest first: the rotation is applied right after the projection is split into heads
    anc.sort(key=lambda t0: -info.order.get(info.producer[t0].name, -1))
    for u in anc:
        for tr_u in (False, True):
            s = info.shape(u)
            rows = s[-1] if tr_u else (s[-2] if len(s) >= 2 else 0)
            if len(s) < 2 or rows != n or \
                    token_view(info.env[u], n, tr_u).shape[1:] != shape_t[1:]:
                continue
            sub = info.region(u, name)
            if sub is None:
                continue
            try:
                ((w, b),) = probe.affine([(u, tr_u)], envs, xs)
            except NotAttention:
                continue
            found = _per_position_map(info, sub, u, tr_u, name, tr, n)
            if found is None:
                continue
            m, parent = found
            rho, defect = rotation_norm_upper(m.reshape(-1, *m.shape[-2:]))
            if not defect <= ROTATION_TOL:
                raise NotAttention(
                    f"tensor {name} is a position-dependent linear map of the projection {u} "
                    f"that is not a rotation (max_i ||M_i^T M_i - I||_F = {defect:.3g}); only "
                    "rotary position embeddings (orthogonal per-position maps) are covered")
            # per query/key head: the projection of the head it reads (GQA shares them)
            return (w[parent], b[parent]), rho
    raise NotAttention(f"tensor {name} is not the same affine map of the layer input at every "
                       "position, nor a per-position rotation of one (rotary embeddings); "
                       "position-dependent query/key maps of other kinds are not covered")
