"""Per-layer local rules for ONNX graphs (2-norm): the graph lowered to the layer graph
(analyzer.lower), its values carried as centre + Lipschitz constant + per-token radii on the
ball (lsa_models/bounds/layer_graph/ball.py). This module adds the generic nodes' rule.

For the models too large for the Jacobian enclosure (lsa_models/engine/driver.py), whose
cost grows with (numel X0)^2: this walk costs one forward pass and the weights' norms.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..bounds.layer_graph import DPAttention, LayerGraph, Norm, OpNode, Verdicts
from ..bounds.layer_graph.ball import (
    BALL_FAMILIES,
    Ball,
    BallNotCertified,
    BallValue,
    ball_family,
    run_ball,
    settle,
)
from ..bounds.numerics import add_up, mul_up
from ..bounds.report import LayerBound
from ..operators import ACTIVATION_TYPES
from .analyzer import lower
from .graph import GraphInfo
from .loading import OnnxModel
from .ops import OPS, Flow, NotCertified, decimal_attr

# Ops that act on each token (last-axis row) alone, or on each entry alone, and whose
# constant bounds every token's deviation too: the radii map as `rho_i -> f rho_i`.
TOKENWISE = {"MatMul", "Gemm", "Neg", "Add", "Sub", "Mul", "Div", "Cast", "Identity",
             "Dropout", *ACTIVATION_TYPES}  # activations act entrywise (lsa_models/operators/)


def _layernorm(layer: OpNode, args: list[Any], ball: Ball) -> list[BallValue | None] | None:
    """A LayerNormalization node over the last axis with constant scale and bias: the
    norm family's ball rule."""
    node = layer.node
    ins = node.inputs
    if len(ins) < 2 or ins[0] not in layer.variables or any(i in layer.variables
                                                            for i in ins[1:]):
        return None
    shape = layer.out_shapes[0]
    if int(node.attrs.get("axis", -1)) % len(shape) != len(shape) - 1:
        return None
    width = int(shape[-1])
    gamma = np.broadcast_to(np.asarray(layer.consts[ins[1]], dtype=np.float64), (width,))
    beta = None if len(ins) < 3 or not ins[2] else np.broadcast_to(
        np.asarray(layer.consts[ins[2]], dtype=np.float64), (width,))
    eps = decimal_attr(float(node.attrs.get("epsilon", 1e-5)))
    if not eps > 0:
        return None
    norm = Norm(node.name, gamma, beta, eps, inputs=[ins[0]], outputs=[node.outputs[0]],
                nodes=[node.name], shape=shape)
    return BALL_FAMILIES[Norm](norm, [args[0]], ball)


def _operands(layer: OpNode, args: list[Any]) -> tuple[list[Any], list[BallValue]]:
    real: list[Any] = []
    variables: list[BallValue] = []
    for name, v in zip(layer.node.inputs, args, strict=True):
        if not name:
            real.append(None)
        elif name in layer.variables:
            if v is None:
                raise BallNotCertified(f"{layer.name}: an input has no local bound")
            variables.append(v)
            real.append(v)
        else:
            real.append(layer.consts[name])
    return real, variables


@ball_family(OpNode)
def _op(layer: OpNode, args: list[Any], ball: Ball) -> list[BallValue | None]:
    node = layer.node
    if node.op_type == "LayerNormalization":
        done = _layernorm(layer, args, ball)
        if done is not None:
            return done
    real, variables = _operands(layer, args)
    centers = [ball.env[o].detach().numpy().astype(np.float64) for o in layer.outputs]
    # the global rule on the tokens the ball reaches
    flows = [Flow(1.0 if len(variables) == 1 else a.lip, a.reach(), tuple(a.center.shape))
             if isinstance(a, BallValue) else a for a in real]
    try:
        local = OPS[node.op_type].bound(node, flows, layer.out_shapes, "2")
    except NotCertified as exc:
        raise BallNotCertified(str(exc)) from None
    if len(variables) == 2 and node.op_type in ("Add", "Sub") and local[0] is not None:
        a, b = variables
        same = a.rho.shape == b.rho.shape == centers[0].shape[:-1]
        rho = a.rho + b.rho if same else math.inf
        return [settle(centers[0], add_up(a.lip, b.lip), rho, ball, bound=local[0].radius)]
    if len(variables) != 1:
        return [None if f is None else settle(c, f.lip, math.inf, ball, bound=f.radius)
                for f, c in zip(local, centers, strict=False)]
    v = variables[0]
    out: list[BallValue | None] = []
    for f, c in zip(local, centers, strict=False):
        if f is None:
            out.append(None)
            continue
        tokenwise = node.op_type in TOKENWISE and c.shape[:-1] == v.center.shape[:-1] and (
            node.op_type not in ("MatMul", "Gemm") or _right_matrix(layer))
        rho = v.rho * f.lip if tokenwise else math.inf
        out.append(settle(c, mul_up(v.lip, f.lip), rho, ball, bound=f.radius))
    if layer.report is not None and local and local[0] is not None:
        ball.acc.report(LayerBound(node.name, layer.report, local[0].lip, nodes=[node.name],
                                   rule=f"global {layer.report} rule"))
    return out


def _right_matrix(layer: OpNode) -> bool:
    """`x @ W` with the input-dependent operand on the left and a constant matrix W: each
    token is mapped alone."""
    ins = layer.node.inputs
    if int(layer.node.attrs.get("transA", 0)) != 0:
        return False
    return ins[0] in layer.variables and len(ins) > 1 and ins[1] in layer.consts \
        and np.asarray(layer.consts[ins[1]]).ndim == 2


def ball_lowering(model: OnnxModel, n: int) -> LayerGraph:
    try:
        info = GraphInfo(model.module, n)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise BallNotCertified(f"the graph cannot be evaluated: {exc}") from None
    return lower(info)[0]


def _probabilities(model: OnnxModel, graph: LayerGraph, env: Any) -> dict[str, np.ndarray]:
    """Each recognised dot-product attention's probabilities at X0, (H, N, N), read from its
    Softmax node's output."""
    outputs = {n.name: n.outputs[0] for n in model.spec.nodes if n.op_type == "Softmax"}
    probs: dict[str, np.ndarray] = {}
    for layer in graph.layers:
        if not isinstance(layer, DPAttention):
            continue
        out = outputs.get(layer.name.removeprefix("attention@"))
        heads = layer.wq.shape[0]
        if out is None or out not in env:
            continue
        p = env[out].detach().numpy().astype(np.float64)
        if p.size != heads * layer.n * layer.n or layer.inputs[0] not in env:
            continue
        p = p.reshape(heads, layer.n, layer.n)
        x = env[layer.inputs[0]].detach().numpy().astype(np.float64)
        if x.size == layer.n * x.shape[-1] and _probabilities_match(layer, x.reshape(
                layer.n, -1), p):
            probs[layer.name] = p
    return probs


def _probabilities_match(layer: DPAttention, x: np.ndarray, p: np.ndarray) -> bool:
    """The Softmax output is this layer's attention, head by head: on every row's support
    its log-probabilities are `s_h q_i . k_j` up to a row constant, with `s_h` at most the
    layer's scale (so a tensor laid out otherwise, or heads in another order, is not used)."""
    heads, _, d = layer.wq.shape
    s_max = 1.0 / math.sqrt(d) if layer.scale is None else abs(float(layer.scale))
    bq = np.zeros((heads, d)) if layer.bq is None else np.asarray(
        layer.bq, dtype=np.float64).reshape(heads, -1)
    for h in range(heads):
        q = x @ np.asarray(layer.wq[h], dtype=np.float64) + bq[h]
        z = q @ (x @ np.asarray(layer.wk[h], dtype=np.float64)).T  # (N, N)
        support = p[h] > 0
        with np.errstate(divide="ignore"):
            lp = np.where(support, np.log(np.where(support, p[h], 1.0)), 0.0)
        dz, dl = [], []
        for i in range(z.shape[0]):
            row = support[i]
            if row.sum() >= 2:
                dz.append(z[i, row] - z[i, row].mean())
                dl.append(lp[i, row] - lp[i, row].mean())
        if not dz:
            continue
        a, b = np.concatenate(dz), np.concatenate(dl)
        zz = float(a @ a)
        s_h = float(a @ b) / zz if zz > 0 else 0.0
        resid = float(np.linalg.norm(b - s_h * a))
        if resid > 1e-6 * (1.0 + float(np.linalg.norm(b))) or s_h > s_max * (1 + 1e-6) \
                or s_h < -1e-9:
            return False
    return True


def ball_bound(model: OnnxModel, x0: np.ndarray, eps: float) -> tuple[float, list[LayerBound]]:
    """Upper bound on sup ||J_F(X)||_2 over {X : ||X - X0||_F <= eps}, with the per-layer
    factors; raises BallNotCertified when a layer has no local rule."""
    x = np.asarray(x0, dtype=np.float64)
    graph = ball_lowering(model, model.spec.seq_len or int(x.shape[-2]))
    with torch.no_grad():
        env = model.module.with_dtype(torch.float64).run_env(torch.from_numpy(x))
    acc = Verdicts()
    out = run_ball(graph, x, eps, env, acc, _probabilities(model, graph, env))
    if not math.isfinite(out.lip):
        raise BallNotCertified("the local constant overflowed")
    return out.lip, acc.layers
