"""The native front end: how each module family lowers to the layer graph (bounds/layer_graph).

One lowering rule per module type, in a registry keyed by type (`RULES`, `register_rule`). A
rule's `lower(module, name, lowering)` returns the module as one layer of the graph: a leaf
(linear, layernorm, activation, attention with its weights, a refusal) or a `Series` /
`Residual` of its children, each lowered with `lowering(child, name)`. The engine's families
bound the layers; nothing here computes a number. `register_rule` is the extension point for
user rules too (lm.py and invertible/rules.py register the library's others).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from ..attention import L2MHA, DotProductMHA, _head_columns
from ..blocks import FeedForward, Transformer, TransformerBlock
from .layer_graph import (
    Activation,
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

__all__ = ["RULES", "Lowering", "LoweringRule", "UnsupportedModuleError", "register_rule",
           "rule_for"]


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


class Lowering(Protocol):
    """What a lowering rule is handed: lowers a child module (and knows N)."""

    seq_len: int

    def __call__(self, module: nn.Module, name: str) -> Layer: ...


RULES: dict[type[nn.Module], Any] = {}


def register_rule(*types: type[nn.Module]) -> Callable[[type], type]:
    """Register a lowering rule class (one with `lower`) for these module types."""

    def deco(cls: type) -> type:
        for t in types:
            RULES[t] = cls()
        return cls

    return deco


def rule_for(module: nn.Module) -> Any | None:
    for klass in type(module).__mro__:
        if klass in RULES:
            return RULES[klass]
    return None


class LoweringRule:
    """Base of the lowering rules."""

    def lower(self, module: Any, name: str, lowering: Lowering) -> Layer:
        raise NotImplementedError


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _series(module: nn.Module, name: str, lowering: Lowering, children: list[str],
            block: bool = False) -> Series:
    return Series(name, [lowering(getattr(module, c), _join(name, c)) for c in children],
                  block=block)


@register_rule(nn.Linear)
class LinearRule(LoweringRule):
    def lower(self, module: nn.Linear, name: str, lowering: Lowering) -> Layer:
        return Linear(name, module.weight, module.bias)


@register_rule(nn.LayerNorm)
class LayerNormRule(LoweringRule):
    def lower(self, module: nn.LayerNorm, name: str, lowering: Lowering) -> Layer:
        if module.weight is None:
            raise UnsupportedModuleError(name, module)  # elementwise_affine=False: add gamma=1
        return Norm(name, module.weight, module.bias, module.eps)


_ACT_KIND = {nn.ReLU: "relu", nn.GELU: "gelu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}


@register_rule(nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid)
class ActivationRule(LoweringRule):
    def lower(self, module: nn.Module, name: str, lowering: Lowering) -> Layer:
        return Activation(name, _ACT_KIND[type(module)])


@register_rule(nn.Identity, nn.Dropout)
class IdentityRule(LoweringRule):
    def lower(self, module: nn.Module, name: str, lowering: Lowering) -> Layer:
        return Identity(name)


@register_rule(nn.Sequential)
class SequentialRule(LoweringRule):
    def lower(self, module: nn.Sequential, name: str, lowering: Lowering) -> Layer:
        return Series(name, [lowering(child, _join(name, child_name))
                             for child_name, child in module.named_children()])


@register_rule(L2MHA)
class L2MHARule(LoweringRule):
    def lower(self, module: L2MHA, name: str, lowering: Lowering) -> Layer:
        cfg = module.config
        if not cfg.tied:
            return Refused(name, "l2_mha_untied", "not_certified", (
                f"{name or 'attention'}: L2 attention with untied query/key weights is not "
                "covered by Theorem 3.2 (it is not Lipschitz in general); retrain with "
                "attention='l2' (tied) to get a certificate"))
        return L2Attention(name, module.query_weights(), module.value_weights(),
                           module.output_weight(), lowering.seq_len, cfg.causal)


@register_rule(DotProductMHA)
class DotProductRule(LoweringRule):
    def lower(self, module: DotProductMHA, name: str, lowering: Lowering) -> Layer:
        h = module.config.n_heads
        wq, wk, wv = (_head_columns(lin.weight, h)
                      for lin in (module.q_proj, module.k_proj, module.v_proj))
        return DPAttention(name, wq, wk, wv, module.out_proj.weight.T, lowering.seq_len,
                           bo=module.out_proj.bias)


@register_rule(FeedForward)
class FeedForwardRule(LoweringRule):
    def lower(self, module: FeedForward, name: str, lowering: Lowering) -> Layer:
        return _series(module, name, lowering, ["fc1", "act", "fc2"])


@register_rule(TransformerBlock)
class BlockRule(LoweringRule):
    def lower(self, module: TransformerBlock, name: str, lowering: Lowering) -> Layer:
        ln1, attn, ln2, ffn = (lowering(getattr(module, s), _join(name, s))
                               for s in ("ln1", "attn", "ln2", "ffn"))
        if module.config.norm_first:  # x + attn(ln1(x)), then x + ffn(ln2(x))
            body: list[Layer] = [Residual(name, Series(name, [ln1, attn])),
                                 Residual(name, Series(name, [ln2, ffn]))]
        else:  # ln1(x + attn(x)), then ln2(x + ffn(x))
            body = [Residual(name, attn), ln1, Residual(name, ffn), ln2]
        return Series(name, body, block=True)


@register_rule(Transformer)
class TransformerRule(LoweringRule):
    def lower(self, module: Transformer, name: str, lowering: Lowering) -> Layer:
        parts = [lowering(blk, _join(name, f"blocks.{i}"))
                 for i, blk in enumerate(module.blocks)]
        if module.final_norm is not None:
            parts.append(lowering(module.final_norm, _join(name, "final_norm")))
        return Series(name, parts)

