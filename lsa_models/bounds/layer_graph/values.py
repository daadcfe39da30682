"""The engine's value type and its verdict accumulator.

`Value` is what is known about one input-dependent tensor: `lip`, a certified Lipschitz
constant of the map from the scope's input to the tensor (2: Frobenius norm of the whole
tensor; inf: largest entry), `radius`, a bound on the 2-norm of every token (last-axis row),
None when unknown, and the tensor's shape (`()` where the front end does not track shapes).
A tensor whose bound failed has no Value (None).

`Verdicts` collects, in evaluation order, what every layer reported (`LayerBound` entries)
and the first reason of each failure kind; a proven "not Lipschitz" outranks a mere "not
certified" whatever their order (the whole map is not Lipschitz if one layer is not and the
rest are, and nothing certifies a map with an uncertified layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..report import LayerBound, Verdict


@dataclass
class Value:
    """Lipschitz constant from the scope input, token-norm bound, shape. `lip` is +inf when
    no finite constant is certified (the reason is in the accumulator) but the token norms
    still are (a post-norm block's output after a refused attention)."""

    lip: float
    radius: float | None  # bound on every last-axis row's 2-norm; None: unknown
    shape: tuple[int, ...] = ()


def failed_value(v: Value | None) -> bool:
    return v is None or not math.isfinite(v.lip)


@dataclass
class Verdicts:
    """The one verdict accumulator: per-layer reports plus every failure, in order."""

    layers: list[LayerBound] = field(default_factory=list)
    failures: list[tuple[Verdict, str | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # float32 readings relied on (ONNX)

    def report(self, layer: LayerBound) -> None:
        self.layers.append(layer)

    def fail(self, status: Verdict, reason: str | None,
             layer: LayerBound | None = None) -> None:
        self.failures.append((status, reason))
        if layer is not None:
            self.layers.append(layer)

    def note(self, notes: list[str]) -> None:
        self.notes.extend(n for n in notes if n not in self.notes)

    def mark(self) -> int:
        """A position in the failure list, for `status` / `reason` of what came after it."""
        return len(self.failures)

    def first(self, status: Verdict, since: int = 0) -> str | None:
        """The reason of the first failure of that kind (None: none, or given without one)."""
        return next((r for s, r in self.failures[since:] if s == status), None)

    def status(self, since: int = 0) -> Verdict:
        kinds = {s for s, _ in self.failures[since:]}
        if "not_lipschitz" in kinds:
            return "not_lipschitz"
        return "not_certified" if "not_certified" in kinds else "certified"

    def reason(self, since: int = 0) -> str | None:
        status = self.status(since)
        return None if status == "certified" else self.first(status, since)

