"""Certified Lipschitz bounds: numerics (upward rounding), formulas, per-module rules, driver."""

from .analyzer import Analyzer, certify
from .report import BoundResult, Domain, LayerBound, Verdict
from .rules import RULES, Bound, UnsupportedModuleError, register_rule

__all__ = [
    "RULES",
    "Analyzer",
    "Bound",
    "BoundResult",
    "Domain",
    "LayerBound",
    "UnsupportedModuleError",
    "Verdict",
    "certify",
    "register_rule",
]
