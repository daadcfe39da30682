"""The local driver: the Jacobian of an ONNX graph enclosed over a ball around one input.

Runs the graph once in float64 at the centre X0 (every tensor's centre value), then walks the
input-dependent nodes in graph order, applying each op's local rule (rules.py) to carry a
`LocalValue` per tensor. At the output, the Jacobian over the ball lies in `jc +- jr`, so
  ||J||_2   <= ||jc||_2 + ||jr||_2             (|E| <= jr entrywise => ||E||_2 <= ||jr||_2)
  ||J||_inf <= max_i sum_j (|jc_ij| + jr_ij)
both computed with upward rounding (docs/local-bounds.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ..bounds.numerics import add_up, inf_norm_upper, spectral_norm_upper
from ..onnx.loading import OnnxModel
from .rules import LOCAL_RULES, exact
from .values import Ball, LocalNotCertified, LocalValue, input_value

# Jacobian entries the engine will hold for one tensor (float64): beyond it, the ball is
# bounded by per-layer rules instead.
MAX_JACOBIAN_ENTRIES = 40_000_000


@dataclass
class LocalJacobian:
    """The enclosure of the graph output's Jacobian over the ball, rows = output entries."""

    ball: Ball
    output: np.ndarray  # F(X0), flattened (K,)
    jc: np.ndarray  # (K, P)
    jr: np.ndarray  # (K, P)
    out_lo: np.ndarray  # enclosure of F over the ball (K,)
    out_hi: np.ndarray
    layers: list[tuple[str, str, float]] = field(default_factory=list)  # (node, kind, factor)

    def upper(self) -> float:
        """Certified bound on sup ||J_F(X)||_p over the ball."""
        if self.ball.norm == "2":
            return add_up(spectral_norm_upper(self.jc), spectral_norm_upper(self.jr))
        return inf_norm_upper(np.abs(self.jc) + self.jr) * (1.0 + 2.0**-50)

    def center_norm(self) -> float:
        """||J_F(X0)|| (float64, not rounded: a reference, not a bound)."""
        o = 2 if self.ball.norm == "2" else np.inf
        return float(np.linalg.norm(self.jc, ord=o))


def graph_input_shape(model: OnnxModel) -> tuple[int, ...]:
    spec = model.spec
    n = spec.seq_len
    if n is None:
        raise ValueError("the graph has a dynamic sequence length: local bounds need a "
                         "fixed one")
    if spec.rank == 2:
        return (n, spec.d_model)
    if spec.batch not in (None, 1):
        raise ValueError(f"the graph has a fixed batch size {spec.batch}; local bounds "
                         "need batch 1")
    return (1, n, spec.d_model)


def check_center(model: OnnxModel, x0: np.ndarray) -> np.ndarray:
    """X0 as the graph input (1, N, D) (or (N, D)); a leading batch dim of 1 allowed."""
    shape = graph_input_shape(model)
    x = np.asarray(x0)
    if not np.issubdtype(x.dtype, np.floating) and not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"the input must hold numbers, got dtype {x.dtype}")
    x = x.astype(np.float64)
    n, d = shape[-2], shape[-1]
    if x.shape not in ((n, d), (1, n, d)):
        raise ValueError(f"the input has shape {tuple(x.shape)}; the model takes one input "
                         f"of shape ({n}, {d}) (a leading batch dimension of 1 allowed)")
    if not np.all(np.isfinite(x)):
        raise ValueError("the input has non-finite entries")
    return x.reshape(shape)


def center_sha256(x0: np.ndarray) -> str:
    """Hash of the centre as float64 little-endian bytes in C order."""
    return hashlib.sha256(np.ascontiguousarray(x0, dtype="<f8").tobytes()).hexdigest()


def _check_eps(eps: float) -> None:
    if not (eps >= 0 and np.isfinite(eps)):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def local_jacobian(model: OnnxModel, x0: np.ndarray, eps: float, norm: str) -> LocalJacobian:
    """Enclose the output's Jacobian over `{X : ||X - X0||_norm <= eps}`. Raises
    LocalNotCertified when an op has no local rule or a range leaves an op's domain."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    _check_eps(eps)
    x = check_center(model, x0)
    spec = model.spec
    module = model.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x))
    ball = Ball(x, float(eps), norm)
    values: dict[str, LocalValue | np.ndarray] = {spec.input_name: input_value(ball)}
    layers: list[tuple[str, str, float]] = []
    for node in module.runtime_nodes:
        args: list[LocalValue | np.ndarray | None] = []
        for i in node.inputs:
            if not i:
                args.append(None)
            elif i in values:
                args.append(values[i])
            else:
                args.append(env[i].detach().numpy() if i in env else None)
        centers = [env[o].detach().to(torch.float64).numpy()
                   if o and o in env and env[o].is_floating_point() else
                   (env[o].detach().numpy() if o and o in env else None)
                   for o in node.outputs]
        if not any(isinstance(a, LocalValue) for a in args):
            for o, c in zip(node.outputs, centers, strict=False):
                if o and c is not None:
                    values[o] = c  # shape arithmetic and constants
            continue
        if node.op_type in ("Shape", "Size"):
            for o, c in zip(node.outputs, centers, strict=False):
                if o and c is not None:
                    values[o] = c
            continue
        rule = LOCAL_RULES.get(node.op_type)
        if rule is None:
            raise LocalNotCertified(f"{node.op_type} node {node.name}: no local rule")
        for c in centers:
            if c is not None and c.size * ball.size > MAX_JACOBIAN_ENTRIES:
                raise LocalNotCertified(f"node {node.name}: the Jacobian enclosure would hold "
                                        f"{c.size * ball.size} entries (limit "
                                        f"{MAX_JACOBIAN_ENTRIES})")
        outs = rule.apply(node, args, centers, ball)
        for o, v in zip(node.outputs, outs, strict=False):
            if o and v is not None:
                values[o] = v
        factor = _layer_factor(node.op_type, args, outs)
        if factor is not None:
            layers.append((node.name, factor[0], factor[1]))
    out = values[spec.output_name]
    if not isinstance(out, LocalValue):
        c = np.asarray(out, dtype=np.float64)
        out = exact(c, ball)
    k = out.center.size
    return LocalJacobian(ball, out.center.reshape(k), out.jc.reshape(k, -1),
                         out.jr.reshape(k, -1), out.lo.reshape(k), out.hi.reshape(k), layers)


_FACTOR_KIND = {"LayerNormalization": "layernorm", "Softmax": "softmax", "Relu":
                "activation:relu", "Gelu": "activation:gelu", "Erf": "activation:erf",
                "Tanh": "activation:tanh", "Sigmoid": "activation:sigmoid"}


def _layer_factor(op: str, args: list, outs: list) -> tuple[str, float] | None:
    """A reported per-layer local factor: the largest slope of an elementwise op over the
    ball, LayerNorm's and Softmax's largest per-token Jacobian row sum (inf-norm style; for
    reading what dominates, the certificate is the whole-graph enclosure)."""
    kind = _FACTOR_KIND.get(op)
    if kind is None or not outs or not isinstance(outs[0], LocalValue):
        return None
    x = args[0]
    if not isinstance(x, LocalValue):
        return None
    y = outs[0]
    # ratio of output to input Jacobian magnitudes is not a factor; instead: the op's own
    # worst slope, reconstructed from the enclosures where the op is entrywise
    if kind.startswith("activation"):
        num = np.abs(y.jc).sum(-1) + y.jr.sum(-1)
        den = np.abs(x.jc).sum(-1) + x.jr.sum(-1)
        ok = den > 0
        return kind, float(np.max(num[ok] / den[ok])) if np.any(ok) else 0.0
    return None
