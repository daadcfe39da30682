"""Bound rules that let `bounds.certify` read the certificates of the contractive blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..bounds.numerics import add_up
from ..bounds.report import Domain, LayerBound, NormName
from ..bounds.rules import Bound, compose, register_rule
from .blocks import ContractiveFFNBlock, ContractiveL2Block, ResidualBlock
from .trunk import ContractiveTrunk

if TYPE_CHECKING:
    from ..bounds.analyzer import Analyzer


def _register_rules() -> None:
    """Let `bounds.certify` read the certificates of these blocks."""

    @register_rule(ContractiveL2Block, ContractiveFFNBlock)
    class ContractiveBlockRule:
        def bound(self, module: ResidualBlock, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            kind = ("contractive_l2_block" if isinstance(module, ContractiveL2Block)
                    else "contractive_ffn_block")
            if norm != "2":
                reason = (f"{name or 'block'}: contractive blocks are scaled by their 2-norm "
                          "bound; certify them with norm '2'")
                return Bound(None, "not_certified", None,
                             [LayerBound(name, kind, None, "not_certified", reason)], reason)
            with torch.no_grad():
                branch = module.lipschitz_upper(domain.seq_len)
            assert branch is not None
            upper = add_up(1.0, branch)
            return Bound(upper, "certified", None, [LayerBound(name, kind, upper)])

    @register_rule(ContractiveTrunk)
    class ContractiveTrunkRule:
        def bound(self, module: ContractiveTrunk, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            prefix = f"{name}." if name else ""
            parts = [analyzer.bound(b, f"{prefix}blocks.{i}", domain)
                     for i, b in enumerate(module.blocks)]
            return compose(parts)
