"""Certified Lipschitz bounds: numerics (upward rounding), formulas, the bound engine
(`layer_graph`: typed layers, value type, verdict accumulator, driver; docs/engine.md) and
the native front end (`rules`: one lowering rule per module type; `analyzer.certify`)."""

from .analyzer import Analyzer, certify
from .report import BoundResult, Domain, LayerBound, Verdict
from .rules import RULES, UnsupportedModuleError, register_rule

__all__ = [
    "RULES",
    "Analyzer",
    "BoundResult",
    "Domain",
    "LayerBound",
    "UnsupportedModuleError",
    "Verdict",
    "certify",
    "register_rule",
]
