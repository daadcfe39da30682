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

from ..bounds.numerics import U, add_up, inf_norm_upper, mul_up, spectral_norm_upper, sqrt_up
from ..onnx.loading import OnnxModel
from ..onnx.ops import Node, decimal_attr
from .primitives import LIBM_REL, derivative
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
    # (node, kind, local factor, rule) per reported layer
    layers: list[tuple[str, str, float, str]] = field(default_factory=list)

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


def local_jacobian(model: OnnxModel, x0: np.ndarray, eps: float, norm: str,
                   telescope: bool = True) -> LocalJacobian:
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
    layers: list[tuple[str, str, float, str]] = []
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
        factor = _layer_factor(node, args, norm)
        if factor is not None:
            layers.append((node.name, *factor))
    out = values[spec.output_name]
    if not isinstance(out, LocalValue):
        c = np.asarray(out, dtype=np.float64)
        out = exact(c, ball)
    k = out.center.size
    jr = out.jr.reshape(k, -1)
    if telescope and eps > 0:
        jr = np.minimum(jr, _telescoped(model, x, values, k, norm))
    return LocalJacobian(ball, out.center.reshape(k), out.jc.reshape(k, -1), jr,
                         out.lo.reshape(k), out.hi.reshape(k), layers)


# Relative allowance on the adjoints G computed by autograd in float64 at the centre (they
# only scale remainder terms): far above float64 backward-pass rounding.
ADJOINT_MARGIN = 1e-9


def _telescoped(model: OnnxModel, x: np.ndarray, values: dict[str, LocalValue | np.ndarray],
                k: int, norm: str) -> np.ndarray:
    """The remainder J(X) - J(X0) bounded by telescoping over the ops in graph order:
    J(X) - J(X0) = sum_ops G_op (D_op(X) - D_op(X0)) J_in(X), with G_op the output's exact
    adjoint at X0 (downstream ops at the centre, so their cancellations are kept) and each
    op's term from its local rule; plus the rounding of the centre Jacobian (the same
    enclosure at eps = 0)."""
    names = [t for t, v in values.items() if isinstance(v, LocalValue) and v.term is not None]
    grads = _adjoints(model, x, names, k)
    total = np.zeros((k, x.size))
    for t in names:
        v = values[t]
        assert isinstance(v, LocalValue) and v.term is not None
        g = grads.get(t)
        if g is None:
            continue
        ga = np.abs(g) * (1 + ADJOINT_MARGIN) + ADJOINT_MARGIN * float(np.abs(g).max())
        total += v.term(ga)
    zero = local_jacobian(model, x, 0.0, norm, telescope=False)
    return (total + zero.jr) * (1 + 1e-12)


def _adjoints(model: OnnxModel, x: np.ndarray, names: list[str],
              k: int) -> dict[str, np.ndarray]:
    """d out_i / d t at X0 for every output entry i and tensor t: (K, *shape(t))."""
    module = model.module.with_dtype(torch.float64)
    xt = torch.from_numpy(x).requires_grad_(True)
    env = module.run_env(xt)
    y = env[model.spec.output_name].reshape(-1)
    ts = [env[t] for t in names]
    rows: list[list[np.ndarray | None]] = []
    for i in range(k):
        gs = torch.autograd.grad(y[i], ts, retain_graph=True, allow_unused=True)
        rows.append([None if g is None else g.detach().numpy() for g in gs])
    out: dict[str, np.ndarray] = {}
    for j, t in enumerate(names):
        if all(r[j] is None for r in rows):
            continue
        zero = np.zeros(tuple(ts[j].shape))
        out[t] = np.stack([zero if (g := r[j]) is None else g for r in rows])
    return out


_ACT = {"Relu": "relu", "Gelu": "gelu", "Erf": "erf", "Tanh": "tanh", "Sigmoid": "sigmoid"}


def _layer_factor(node: Node, args: list, norm: str) -> tuple[str, float, str] | None:
    """A reported per-layer local factor (what dominates; the certificate is the whole-graph
    enclosure): LayerNorm's constant on the ball from a lower bound on each token's centred
    norm, an activation's largest slope over its input range."""
    x = args[0] if args else None
    if not isinstance(x, LocalValue):
        return None
    if node.op_type == "LayerNormalization" and isinstance(args[1], np.ndarray):
        d = x.shape[-1]
        eps = decimal_attr(float(node.attrs.get("epsilon", 1e-5)))
        pc = x.center - x.center.mean(axis=-1, keepdims=True)
        cn = np.sqrt(np.square(pc).sum(axis=-1)) * (1 - 4 * U)  # ||P x0_i||, rounded down
        rho = np.sqrt(np.square(x.rad).sum(axis=-1)) * (1 + 4 * U)  # ||x - x0|| per token
        low = np.maximum(cn - rho, 0.0)
        sigma = np.sqrt((low * low / d + eps) * (1 - 4 * U)) * (1 - 2 * U)
        gmax = float(np.abs(args[1]).max())
        f = float(np.max(gmax / sigma)) * (1 + 8 * U)
        if norm == "inf":
            f = mul_up(f, sqrt_up(d))
        return ("layernorm", f, "local LayerNorm: max|gamma| / sqrt(max(0, ||P x0|| - rho)^2"
                "/D + eps) per token" + (" x sqrt(D) (inf)" if norm == "inf" else ""))
    kind = _ACT.get(node.op_type)
    if kind is None or (kind == "gelu" and node.attrs.get("approximate", b"none")
                        not in (b"none", "none")):
        return None
    _, rng = derivative(kind, x.lo, x.hi)
    dlo, dhi = rng(x.lo, x.hi)
    f = float(np.max(np.maximum(np.abs(dlo), np.abs(dhi)))) * (1 + LIBM_REL) + 1e-300
    return (f"activation:{kind}", f, f"local {kind}: largest slope over the input's range")
