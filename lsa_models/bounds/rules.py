"""How each module family is bounded: one rule class per family, in a registry keyed by type.

A rule receives the module, the norm and the input domain, and returns a `Bound`: its
certified constant (or a verdict why there is none), the domain of its output (so bounded-
domain rules downstream can use it) and the per-layer entries for the report. Composite
modules (blocks, stacks) combine their children's bounds through the `Analyzer` that walks
the model (analyzer.py); leaf rules never recurse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from .formulas import l2_mha_bound, layernorm_bound, linear_bound
from .numerics import ACTIVATION_LIPSCHITZ, add_up, mul_up, sqrt_up
from .report import Domain, LayerBound, NormName, Verdict

if TYPE_CHECKING:
    from .analyzer import Analyzer


@dataclass
class Bound:
    upper: float | None
    status: Verdict
    out_radius: float | None
    layers: list[LayerBound] = field(default_factory=list)
    reason: str | None = None


class UnsupportedModuleError(TypeError, ValueError):
    """A module type without a bound rule (a ValueError too: it is the input that is wrong)."""

    def __init__(self, name: str, module: nn.Module) -> None:
        kind = type(module).__name__
        super().__init__(
            f"no Lipschitz rule for module {name or '<root>'} of type {kind}; supported: "
            f"{', '.join(sorted(t.__name__ for t in RULES))}. Rebuild the model from lsa_models "
            f"layers or register a rule with lsa_models.bounds.register_rule"
        )
        self.module_name = name
        self.module_type = kind


class Rule(Protocol):
    def bound(self, module: Any, name: str, norm: NormName, domain: Domain,
              analyzer: Analyzer) -> Bound: ...


RULES: dict[type[nn.Module], Rule] = {}


def register_rule(*types: type[nn.Module]) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        for t in types:
            RULES[t] = cls()
        return cls

    return deco


def rule_for(module: nn.Module) -> Rule | None:
    for klass in type(module).__mro__:
        if klass in RULES:
            return RULES[klass]
    return None


def leaf(name: str, kind: str, upper: float, out_radius: float | None) -> Bound:
    return Bound(upper, "certified", out_radius, [LayerBound(name, kind, upper)])


def compose(bounds: list[Bound]) -> Bound:
    """Sequential composition: `Lip(f o g) <= Lip(f) Lip(g)`."""
    layers = [lb for b in bounds for lb in b.layers]
    worst = _worst(bounds)
    if worst is not None:
        return Bound(None, worst.status, None, layers, worst.reason)
    return Bound(mul_up(*(b.upper or 0.0 for b in bounds)) if bounds else 1.0, "certified",
                 bounds[-1].out_radius if bounds else None, layers)


def residual(branch: Bound, in_radius: float | None) -> Bound:
    """`x + g(x)`: `Lip <= 1 + Lip(g)`; token norms add."""
    if branch.upper is None:
        return Bound(None, branch.status, None, branch.layers, branch.reason)
    out_r = None if in_radius is None or branch.out_radius is None else add_up(
        in_radius, branch.out_radius)
    return Bound(add_up(1.0, branch.upper), "certified", out_r, branch.layers)


def _worst(bounds: list[Bound]) -> Bound | None:
    # A layer proven not Lipschitz dominates one that is merely not certified.
    for status in ("not_lipschitz", "not_certified"):
        for b in bounds:
            if b.status == status:
                return b
    return None


@register_rule(nn.Linear)
class LinearRule:
    def bound(self, module: nn.Linear, name: str, norm: NormName, domain: Domain,
              analyzer: Analyzer) -> Bound:
        upper = linear_bound(module.weight, norm)
        out_r = None
        if domain.radius is not None:
            w2 = upper if norm == "2" else linear_bound(module.weight, "2")
            bias = 0.0 if module.bias is None else linear_bound(module.bias[None, :], "2")
            out_r = add_up(mul_up(w2, domain.radius), bias)
        return leaf(name, "linear", upper, out_r)


@register_rule(nn.LayerNorm)
class LayerNormRule:
    def bound(self, module: nn.LayerNorm, name: str, norm: NormName, domain: Domain,
              analyzer: Analyzer) -> Bound:
        if module.weight is None:
            raise UnsupportedModuleError(name, module)  # elementwise_affine=False: add gamma=1
        upper = layernorm_bound(module.weight, module.eps, norm)
        # (x - mean)/sqrt(var + eps) has 2-norm < sqrt(D): the output is bounded whatever
        # the input, which is what makes pre-norm blocks' attention inputs bounded.
        dim = module.weight.numel()
        gmax = float(module.weight.detach().abs().max())
        beta = 0.0 if module.bias is None else linear_bound(module.bias[None, :], "2")
        out_r = add_up(mul_up(sqrt_up(dim), gmax), beta)
        return leaf(name, "layernorm", upper, out_r)


_ACT_KIND = {nn.ReLU: "relu", nn.GELU: "gelu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}


@register_rule(nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid)
class ActivationRule:
    def bound(self, module: nn.Module, name: str, norm: NormName, domain: Domain,
              analyzer: Analyzer) -> Bound:
        kind = _ACT_KIND[type(module)]
        upper = ACTIVATION_LIPSCHITZ[kind]
        out_r = None
        if domain.radius is not None and kind != "sigmoid":
            # act(0) = 0 and |act(x)| <= L|x| coordinate-wise (sigmoid(0) = 1/2: left unbounded).
            out_r = mul_up(upper, domain.radius)
        return leaf(name, f"activation:{kind}", upper, out_r)


@register_rule(nn.Identity, nn.Dropout)
class IdentityRule:
    def bound(self, module: nn.Module, name: str, norm: NormName, domain: Domain,
              analyzer: Analyzer) -> Bound:
        return Bound(1.0, "certified", domain.radius, [])


@register_rule(nn.Sequential)
class SequentialRule:
    def bound(self, module: nn.Sequential, name: str, norm: NormName, domain: Domain,
              analyzer: Analyzer) -> Bound:
        parts = []
        for child_name, child in module.named_children():
            b = analyzer.bound(child, _join(name, child_name), domain)
            parts.append(b)
            domain = domain.with_radius(b.out_radius)
        return compose(parts)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _register_lsa_rules() -> None:
    from ..attention import L2MHA, DotProductMHA
    from ..blocks import FeedForward, Transformer, TransformerBlock

    @register_rule(L2MHA)
    class L2MHARule:
        def bound(self, module: L2MHA, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            cfg = module.config
            if not cfg.tied:
                reason = (f"{name or 'attention'}: L2 attention with untied query/key weights "
                          "is not covered by Theorem 3.2 (it is not Lipschitz in general); "
                          "retrain with attention='l2' (tied) to get a certificate")
                return Bound(None, "not_certified", None,
                             [LayerBound(name, "l2_mha_untied", None, "not_certified", reason)],
                             reason)
            upper = l2_mha_bound(module.query_weights(), module.value_weights(),
                                 module.output_weight(), domain.seq_len, norm, cfg.causal)
            kind = "l2_mha_causal" if cfg.causal else "l2_mha"
            return leaf(name, kind, upper, None)

    @register_rule(DotProductMHA)
    class DotProductRule:
        def bound(self, module: DotProductMHA, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            if domain.radius is None:
                reason = (f"{name or 'attention'}: dot-product attention is not Lipschitz on an "
                          "unbounded domain (Theorem 3.1); give an input radius to bound it on "
                          "a bounded domain")
                status: Verdict = "not_lipschitz"
                return Bound(None, status, None,
                             [LayerBound(name, "dp_mha", None, status, reason)], reason)
            from ..attention import _head_columns
            from .formulas import dp_mha_ball

            h = module.config.n_heads
            wq, wk, wv = (_head_columns(lin.weight, h)
                          for lin in (module.q_proj, module.k_proj, module.v_proj))
            wo = module.out_proj.weight.T
            upper, out_r = dp_mha_ball(wq, wk, wv, wo, domain.seq_len, domain.radius, norm,
                                       bo=module.out_proj.bias)
            return leaf(name, "dp_mha_radius", upper, out_r)

    @register_rule(FeedForward)
    class FeedForwardRule:
        def bound(self, module: FeedForward, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            parts = []
            for child_name in ("fc1", "act", "fc2"):
                b = analyzer.bound(getattr(module, child_name), _join(name, child_name), domain)
                parts.append(b)
                domain = domain.with_radius(b.out_radius)
            return compose(parts)

    @register_rule(TransformerBlock)
    class BlockRule:
        def bound(self, module: TransformerBlock, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            sub = [_join(name, s) for s in ("ln1", "attn", "ln2", "ffn")]
            if module.config.norm_first:
                ln1 = analyzer.bound(module.ln1, sub[0], domain)
                attn = analyzer.bound(module.attn, sub[1], domain.with_radius(ln1.out_radius))
                r1 = residual(compose([ln1, attn]), domain.radius)
                d1 = domain.with_radius(r1.out_radius)
                ln2 = analyzer.bound(module.ln2, sub[2], d1)
                ffn = analyzer.bound(module.ffn, sub[3], d1.with_radius(ln2.out_radius))
                r2 = residual(compose([ln2, ffn]), d1.radius)
                total = compose([r1, r2])
            else:
                attn = analyzer.bound(module.attn, sub[1], domain)
                r1 = residual(attn, domain.radius)
                ln1 = analyzer.bound(module.ln1, sub[0], domain.with_radius(r1.out_radius))
                d1 = domain.with_radius(ln1.out_radius)
                ffn = analyzer.bound(module.ffn, sub[3], d1)
                r2 = residual(ffn, d1.radius)
                ln2 = analyzer.bound(module.ln2, sub[2], d1.with_radius(r2.out_radius))
                total = compose([r1, ln1, r2, ln2])
                total.out_radius = ln2.out_radius
            total.layers.append(LayerBound(name, "block", total.upper, total.status,
                                           total.reason))
            return total

    @register_rule(Transformer)
    class TransformerRule:
        def bound(self, module: Transformer, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            parts = []
            for i, blk in enumerate(module.blocks):
                b = analyzer.bound(blk, _join(name, f"blocks.{i}"), domain)
                parts.append(b)
                domain = domain.with_radius(b.out_radius)
            if module.final_norm is not None:
                parts.append(analyzer.bound(module.final_norm, _join(name, "final_norm"), domain))
            return compose(parts)


_register_lsa_rules()
