"""Lowering rules that let `bounds.certify` read the certificates of the contractive blocks:
each block is a `CertifiedResidual` layer (`x + g(x)`, `Lip_2(g)` its own certified bound),
the trunk a `Series` of its blocks."""

from __future__ import annotations

from ..bounds.layer_graph import CertifiedResidual, Layer, Series
from ..bounds.rules import Lowering, LoweringRule, register_rule
from .blocks import ContractiveFFNBlock, ContractiveL2Block, ResidualBlock
from .trunk import ContractiveTrunk


@register_rule(ContractiveL2Block, ContractiveFFNBlock)
class ContractiveBlockRule(LoweringRule):
    def lower(self, module: ResidualBlock, name: str, lowering: Lowering) -> Layer:
        kind = ("contractive_l2_block" if isinstance(module, ContractiveL2Block)
                else "contractive_ffn_block")
        return CertifiedResidual(name, kind, module, lowering.seq_len)


@register_rule(ContractiveTrunk)
class ContractiveTrunkRule(LoweringRule):
    def lower(self, module: ContractiveTrunk, name: str, lowering: Lowering) -> Layer:
        prefix = f"{name}." if name else ""
        return Series(name, [lowering(b, f"{prefix}blocks.{i}")
                             for i, b in enumerate(module.blocks)])
