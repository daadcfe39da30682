"""The driver that walks a native model and combines its layers' rules into one certificate."""

from __future__ import annotations

import torch
from torch import nn

from .report import BoundResult, Domain, NormName
from .rules import Bound, UnsupportedModuleError, rule_for

METHOD = ("analytic: Theorem 3.2 (Kim et al. 2021) + LayerNorm/linear/activation rules, "
          "composition; float64 with upward rounding")


class Analyzer:
    def __init__(self, norm: NormName) -> None:
        if norm not in ("2", "inf"):
            raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
        self.norm: NormName = norm

    def bound(self, module: nn.Module, name: str, domain: Domain) -> Bound:
        rule = rule_for(module)
        if rule is None:
            raise UnsupportedModuleError(name, module)
        return rule.bound(module, name, self.norm, domain, self)


def norm_name(norm: NormName | float) -> NormName:
    """"2" / "inf", or torch.linalg's spelling of the same norms: 2 and float("inf")."""
    if isinstance(norm, (int, float)) and not isinstance(norm, bool):
        if norm == 2:
            return "2"
        if norm == float("inf"):
            return "inf"
    if norm in ("2", "inf"):
        return norm
    raise ValueError(f"unknown norm {norm!r}; use 2 or float('inf') (or '2' / 'inf')")


def certify(model: nn.Module, norm: NormName | float, seq_len: int,
            radius: float | None = None) -> BoundResult:
    """Certified upper bound on `Lip_norm(model)` for inputs in R^{seq_len x D}, or the verdict
    why there is none. `norm`: "2" or "inf", or 2 / float("inf") as in torch.linalg. Weights
    are read in float64; the model is not run."""
    norm = norm_name(norm)
    domain = Domain(seq_len, radius)
    with torch.no_grad():
        b = Analyzer(norm).bound(model, "", domain)
    return BoundResult(
        norm=norm,
        seq_len=seq_len,
        radius=radius,
        verdict=b.status,
        upper=b.upper,
        layers=b.layers,
        method=METHOD,
        reason=b.reason,
    )
