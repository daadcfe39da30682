"""One bound class per layer family, in a registry keyed by layer type (auto_LiRPA's per-op
bound classes). A family gives a layer's own constant and output radius from a unit input
(`local`: the input `Value` has lip 1.0 and the input's radius), or None when the layer has
no certified bound (after recording why in the verdict accumulator); the driver composes it
with the input's constant. Families of layers with several inputs (ONNX nodes) override
`bound`, which sees the input values themselves.

The formulas are bounds/formulas.py's, rounded upward (bounds/numerics.py); the refusal
reasons are written here once for both front ends.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..formulas import dp_mha_ball, l2_mha_bound, layernorm_bound, linear_bound
from ..numerics import (
    LAYER_ACTIVATION_LIPSCHITZ,
    _as_float64,
    add_up,
    inv_sqrt_up,
    mul_up,
    sqrt_up,
)
from ..report import LayerBound, Verdict
from .layers import (
    Activation,
    CertifiedResidual,
    DPAttention,
    Identity,
    L2Attention,
    Layer,
    Linear,
    Norm,
    Refused,
    Residual,
    Series,
)
from .values import Value, failed_value

if TYPE_CHECKING:
    from .driver import Context


class Family:
    """The bound class of one layer kind."""

    def local(self, layer: Any, x: Value, ctx: Context) -> Value | None:
        raise NotImplementedError

    def bound(self, layer: Any, args: list[Value | None], ctx: Context) -> list[Value | None]:
        return [ctx.step(layer, args[0] if args else None)]


FAMILIES: dict[type[Layer], Family] = {}


def register_family(*kinds: type[Layer]) -> Any:
    def deco(cls: type[Family]) -> type[Family]:
        for k in kinds:
            FAMILIES[k] = cls()
        return cls

    return deco


def family_of(layer: Layer) -> Family:
    for klass in type(layer).__mro__:
        if klass in FAMILIES:
            return FAMILIES[klass]
    raise TypeError(f"no bound family for layer kind {type(layer).__name__}")


def rmsnorm_bound(gamma: Any, eps: float, norm: str) -> float:
    """RMSNorm `y = g * x / sqrt(mean(x^2) + eps)` per token (docs/bounds.md, "RMSNorm"):
    `max|g| / sqrt(eps)` in the 2-norm, `max|g| (1 + sqrt(D)) / sqrt(eps)` in the inf-norm,
    rounded up."""
    g = np.abs(np.asarray(gamma, dtype=np.float64)).reshape(-1)
    if not eps > 0:
        raise ValueError("RMSNorm with epsilon <= 0 is not Lipschitz")
    base = mul_up(float(g.max()), inv_sqrt_up(eps))
    if norm == "2":
        return base
    if norm == "inf":
        return mul_up(base, add_up(1.0, sqrt_up(g.size)))
    raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")


@register_family(Linear)
class LinearFamily(Family):
    def local(self, layer: Linear, x: Value, ctx: Context) -> Value | None:
        upper = linear_bound(layer.weight, ctx.norm)
        out_r = None
        if x.radius is not None:
            # token norms: ||x W^T + b|| <= ||W||_2 ||x|| + ||b||
            w2 = upper if ctx.norm == "2" else linear_bound(layer.weight, "2")
            bias = 0.0 if layer.bias is None else linear_bound(layer.bias[None, :], "2")
            out_r = add_up(mul_up(w2, x.radius), bias)
        ctx.acc.report(LayerBound(layer.name, "linear", upper, nodes=layer.nodes))
        return Value(upper, out_r, layer.shape)


@register_family(Norm)
class NormFamily(Family):
    def local(self, layer: Norm, x: Value, ctx: Context) -> Value | None:
        g = np.abs(_as_float64(layer.gamma))
        dim, gmax = g.size, float(g.max())
        if layer.rms:  # docs/bounds.md, "RMSNorm": output tokens below sqrt(D) max|g|
            upper = rmsnorm_bound(layer.gamma, layer.eps, ctx.norm)
            out_r = mul_up(sqrt_up(dim), gmax)
        else:
            upper = layernorm_bound(layer.gamma, layer.eps, ctx.norm)
            # (x - mean)/sqrt(var + eps) has 2-norm < sqrt(D): the output is bounded whatever
            # the input, which is what makes pre-norm blocks' attention inputs bounded.
            beta = 0.0 if layer.beta is None else linear_bound(layer.beta[None, :], "2")
            out_r = add_up(mul_up(sqrt_up(dim), gmax), beta)
        kind = "rmsnorm" if layer.rms else "layernorm"
        ctx.acc.report(LayerBound(layer.name, kind, upper, nodes=layer.nodes))
        return Value(upper, out_r, layer.shape)


@register_family(Activation)
class ActivationFamily(Family):
    def local(self, layer: Activation, x: Value, ctx: Context) -> Value | None:
        upper = LAYER_ACTIVATION_LIPSCHITZ[layer.act]
        out_r = None
        if x.radius is not None and layer.act != "sigmoid":
            # act(0) = 0 and |act(x)| <= L|x| coordinate-wise (sigmoid(0) = 1/2: left unbounded).
            out_r = mul_up(upper, x.radius)
        ctx.acc.report(LayerBound(layer.name, f"activation:{layer.act}", upper,
                                  nodes=layer.nodes))
        return Value(upper, out_r, layer.shape)


@register_family(Identity)
class IdentityFamily(Family):
    def local(self, layer: Identity, x: Value, ctx: Context) -> Value | None:
        return Value(1.0, x.radius, layer.shape or x.shape)


@register_family(DPAttention)
class DPAttentionFamily(Family):
    def local(self, layer: DPAttention, x: Value, ctx: Context) -> Value | None:
        ctx.acc.note(layer.notes)
        if x.radius is None:
            name = layer.name or "attention"
            status: Verdict
            if ctx.input_bounded:
                status = "not_certified"
                reason = (f"{name}: dot-product attention whose input token norms are not "
                          "bounded by the analysis (the radius does not reach it)")
            else:
                status = "not_lipschitz"
                reason = (f"{name}: dot-product attention is not Lipschitz on an unbounded "
                          "domain (Theorem 3.1); give an input radius to bound it on a "
                          "bounded domain")
            ctx.acc.fail(status, reason, LayerBound(layer.name, "dp_mha", None, status, reason,
                                                    layer.nodes))
            return None
        upper, out_r = dp_mha_ball(layer.wq, layer.wk, layer.wv, layer.wo, layer.n, x.radius,
                                   ctx.norm, scale=layer.scale, bq=layer.bq, bv=layer.bv,
                                   bo=layer.bo, bk=layer.bk, replaced=layer.replaced)
        ctx.acc.report(LayerBound(layer.name, "dp_mha_radius", upper, nodes=layer.nodes))
        return Value(upper, out_r, layer.shape)


@register_family(L2Attention)
class L2AttentionFamily(Family):
    def local(self, layer: L2Attention, x: Value, ctx: Context) -> Value | None:
        ctx.acc.note(layer.notes)
        upper = l2_mha_bound(layer.wq, layer.wv, layer.wo, layer.n, ctx.norm, layer.causal)
        kind = "l2_mha_causal" if layer.causal else "l2_mha"
        ctx.acc.report(LayerBound(layer.name, kind, upper, nodes=layer.nodes))
        return Value(upper, None, layer.shape)


@register_family(Refused)
class RefusedFamily(Family):
    def local(self, layer: Refused, x: Value, ctx: Context) -> Value | None:
        ctx.acc.fail(layer.status, layer.reason, LayerBound(
            layer.name, layer.kind, None, layer.status, layer.reason, layer.nodes))
        return None


@register_family(Series)
class SeriesFamily(Family):
    """`Lip(f_k o ... o f_1) <= prod Lip(f_i)`; each part sees the previous one's radius.
    A failed part fails the series; the parts after it are still bounded (from the failed
    part's radius, if it has one) so that the report lists them all. A failed block still
    passes on its last part's radius (a post-norm block ends in a LayerNorm, whose output is
    bounded whatever its input)."""

    def local(self, layer: Series, x: Value, ctx: Context) -> Value | None:
        if not layer.body:
            return Value(1.0, None, layer.shape)
        since = ctx.acc.mark()
        lip, radius, failed = 1.0, x.radius, False
        for part in layer.body:
            f = ctx.local(part, Value(1.0, radius, x.shape))
            radius = None if f is None else f.radius
            if f is None or failed_value(f):
                failed = True
            else:  # from 1.0 by the fold chain: exactly mul_up(f_1, ..., f_k)
                lip = ctx.compose(lip, f.lip)
        if layer.block:
            ctx.acc.report(LayerBound(layer.name, "block", None if failed else lip,
                                      ctx.acc.status(since), ctx.acc.reason(since)))
        if failed:
            return Value(math.inf, radius if layer.block else None, layer.shape)
        return Value(lip, radius, layer.shape)


@register_family(Residual)
class ResidualFamily(Family):
    """`x + g(x)`: `Lip <= 1 + Lip(g)`; token norms add."""

    def local(self, layer: Residual, x: Value, ctx: Context) -> Value | None:
        g = ctx.local(layer.branch, x)
        if g is None or failed_value(g):
            return None
        r = None if x.radius is None or g.radius is None else add_up(x.radius, g.radius)
        return Value(add_up(1.0, g.lip), r, layer.shape)


@register_family(CertifiedResidual)
class CertifiedResidualFamily(Family):
    """`x + g(x)` with `Lip_2(g) <= c` certified by the block itself (`lipschitz_upper`, the
    bound its branch is scaled by): `Lip_2 <= 1 + c`. The certificate is a 2-norm one only,
    so other norms are refused; the output radius is not tracked (None)."""

    def local(self, layer: CertifiedResidual, x: Value, ctx: Context) -> Value | None:
        if ctx.norm != "2":
            reason = (f"{layer.name or 'block'}: contractive blocks are scaled by their 2-norm "
                      "bound; certify them with norm '2'")
            ctx.acc.fail("not_certified", reason, LayerBound(
                layer.name, layer.kind, None, "not_certified", reason, layer.nodes))
            return None
        with torch.no_grad():
            branch = layer.block.lipschitz_upper(layer.n)
        upper = add_up(1.0, float(branch))
        ctx.acc.report(LayerBound(layer.name, layer.kind, upper, nodes=layer.nodes))
        return Value(upper, None, layer.shape)

