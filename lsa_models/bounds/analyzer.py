"""The native front end's entry point: lower a model (rules.py) and run the bound engine
(layer_graph/) over it."""

from __future__ import annotations

import torch
from torch import nn

from .layer_graph import Context, Layer, Value, Verdicts
from .layer_graph.values import failed_value
from .report import BoundResult, Domain, NormName
from .rules import UnsupportedModuleError, rule_for

METHOD = ("analytic: Theorem 3.2 (Kim et al. 2021) + LayerNorm/linear/activation rules, "
          "composition; float64 with upward rounding")


class _Lowering:
    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __call__(self, module: nn.Module, name: str) -> Layer:
        rule = rule_for(module)
        if rule is None:
            raise UnsupportedModuleError(name, module)
        return rule.lower(module, name, self)


class Analyzer:
    """Lowers native modules to one layer each (`lower`) for the engine, in one norm."""

    def __init__(self, norm: NormName) -> None:
        if norm not in ("2", "inf"):
            raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
        self.norm: NormName = norm

    def lower(self, module: nn.Module, name: str, seq_len: int) -> Layer:
        return _Lowering(seq_len)(module, name)


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
    Domain(seq_len, radius)  # validates both
    acc = Verdicts()
    with torch.no_grad():
        root = Analyzer(norm).lower(model, "", seq_len)
        value = Context(norm, "fold", acc, radius is not None).local(root, Value(1.0, radius))
    verdict = acc.status()
    upper = None if value is None or failed_value(value) or verdict != "certified" else value.lip
    return BoundResult(norm=norm, seq_len=seq_len, radius=radius, verdict=verdict, upper=upper,
                       layers=acc.layers, method=METHOD, reason=acc.reason())
