"""The local constant's routes besides the Jacobian enclosure (drivers/jacobian.py), each a number
`certify_local` takes the smallest of (their order and when each is tried: routes/table.py): the
global per-layer analysis on the tokens the ball reaches, the adjoint graph's bound and the
tangent graph's; and the facts about a graph the routes' choices read (attention, the
output's size, whether second-order symbols fit).
"""

from __future__ import annotations

import numpy as np
import torch

from lsa_models.bounds.numerics import mul_up, sqrt_up
from lsa_models.bounds.report import BoundResult, NormName
from lsa_models.engine.affine.form import MAX_FORM_ENTRIES, quad_size
from lsa_models.engine.derived.adjoint import AdjointGraph
from lsa_models.engine.derived.tangent import TangentGraph
from lsa_models.engine.routes.errors import NOT_APPLICABLE
from lsa_models.onnx.analyzer import analyse
from lsa_models.onnx.loading import OnnxModel

METHOD = ("local: Jacobian enclosure over the ball {X : ||X - X0|| <= eps}, op by op "
          "(docs/local-bounds.md): centre Jacobian exact in float64, remainder by "
          "telescoping over the ops; the best of it and the global bound; upward "
          "rounding")


def global_bound(model: OnnxModel, norm: NormName, x: np.ndarray, eps: float) -> BoundResult:
    """The global analysis on the tokens the ball can reach: each token's 2-norm is at most
    ||x0_i|| + eps (2-ball) or ||x0_i|| + eps sqrt(D) (inf-ball)."""

    d = x.shape[-1]
    rows = np.sqrt(np.square(x.reshape(-1, d)).sum(axis=1))  # (N,)
    reach = eps if norm == "2" else mul_up(eps, sqrt_up(d))
    radius = float(np.nextafter(float(rows.max()) * (1 + 1e-15), np.inf)) + reach
    return analyse(model, norm, model.spec.seq_len, radius * (1 + 1e-12))


TANGENT_METHOD = ("smallest here: the tangent graph's affine forms over the ball and the "
                  "direction box (docs/local-graphs.md, 'The inf-ball by the tangent graph')")


# the tangent graph is tried where the best bound exceeds the centre's norm by this factor, on
# inputs of at most TANGENT_MAX_INPUT entries (its forms carry 2 P columns and more)
TANGENT_GAIN, TANGENT_MAX_INPUT = 1.02, 4096


def tangent_bound(om: OnnxModel, x: np.ndarray, eps: float, norm: str) -> float | None:
    """inf-ball: max_i sup ||row i of J(X)||_1 from the tangent graph (derived/tangent.py); None
    where a node has no tangent rule or the forms do not reach the output."""
    if norm != "inf" or eps <= 0 or x.size > TANGENT_MAX_INPUT:
        return None
    try:
        # with second-order symbols where the graph has attention (its forms 1.4x the time,
        # 2x tighter on larger balls: products of two input-dependent tensors keep their
        # quadratic parts)
        rows = TangentGraph(om, x).bound(eps, quad=use_quad(om, x))
    except NOT_APPLICABLE:
        # an optional candidate: a graph it cannot take keeps the other bounds
        return None
    return None if rows is None else float(rows.max())


def has_attention(om: OnnxModel) -> bool:
    """Whether the graph has a Softmax (attention)."""
    return any(nd.op_type == "Softmax" for nd in om.module.runtime_nodes)  # type: ignore[union-attr]


def use_quad(om: OnnxModel, x: np.ndarray) -> bool:
    """Whether the walks get second-order symbols (affine.QUAD): graphs with attention
    (products of two input-dependent tensors, where they pay), while the widest tensor's form
    with their P(P+1)/2 columns fits half the form budget (an 8-token, D = 16 Transformer:
    512 x 8384 entries; HF GPT-2 at P = 256 does not fit and keeps the plain walks)."""
    if not has_attention(om):
        return False
    module = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x))
    widest = max(int(t.numel()) for t in env.values() if isinstance(t, torch.Tensor))
    return widest * (x.size + quad_size(x.size)) <= MAX_FORM_ENTRIES // 2


ADJOINT_METHOD = ("smallest here: the adjoint graph's affine forms over the ball, one per "
                  "output row (docs/local-graphs.md, 'Margin gradients by the adjoint graph')")
# the adjoint graph walks once per output entry: on outputs of at most this many entries
ADJOINT_MAX_ROWS = 32


def output_size(om: OnnxModel, x: np.ndarray) -> int:
    """The number of output entries at x (the adjoint graphs' weight vectors' size): the
    graph run once on x as its input (x has the graph input's shape; the module's forward
    would read the first axis of a graph without a batch axis as a batch)."""
    out = om.spec.output_name
    with torch.no_grad():
        env = om.module.with_dtype(torch.float64).run_env(torch.from_numpy(x), stop=out)
    return int(env[out].numel())


def adjoint_bound(om: OnnxModel, x: np.ndarray, eps: float, norm: str) -> float | None:
    """inf-ball: max_i sup ||J(X)^T e_i||_1 over the ball from the adjoint graph of every
    output entry i (derived/adjoint.py); None where a node has no adjoint rule, the output is larger
    than ADJOINT_MAX_ROWS entries, or a walk does not reach the input."""
    if norm != "inf" or eps <= 0 or x.size > TANGENT_MAX_INPUT:
        return None
    try:
        k = output_size(om, x)
        if k > ADJOINT_MAX_ROWS:
            return None
        rows = adjoint_bounds({i: AdjointGraph(om, x, np.eye(k)[i]) for i in range(k)},
                               eps, norm)
        if rows is None:
            return None
        best = max(rows.values())
    except NOT_APPLICABLE:
        # an optional candidate: a graph it cannot take keeps the other bounds
        return None
    return best


def adjoint_bounds(graphs: dict[int, AdjointGraph], r: float, norm: str
                    ) -> dict[int, float] | None:
    """Every graph's dual-norm bound on the ball, the forward graph's forms walked once."""
    out: dict[int, float] = {}
    try:
        primal = next(iter(graphs.values())).primal_forms(r, norm)
        for j, g in graphs.items():
            v = g.dual_norm_bound(r, norm, primal)
            if v is None:
                return None
            out[j] = v
    except NOT_APPLICABLE:
        return None
    return out

