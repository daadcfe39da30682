"""The analyser's result, as plain dataclasses (the wire schema lives in `api_schemas`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Verdict = Literal["certified", "not_lipschitz", "not_certified"]
NormName = Literal["2", "inf"]


@dataclass(frozen=True)
class Domain:
    """What is perturbed: sequences of `seq_len` tokens, each token's 2-norm <= radius
    (None: unbounded, all of R^{N x D})."""

    seq_len: int
    radius: float | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.radius is not None and not self.radius >= 0:
            raise ValueError(f"radius must be >= 0, got {self.radius}")


@dataclass
class LayerBound:
    """One layer's certified constant. `upper` is None when no finite bound is certified."""

    name: str
    kind: str
    upper: float | None
    status: Verdict = "certified"
    reason: str | None = None
    nodes: list[str] = field(default_factory=list)
    # the rule that produced `upper` (local reports) and the global factor it replaced
    rule: str | None = None
    global_upper: float | None = None


@dataclass
class BoundResult:
    norm: NormName
    seq_len: int
    radius: float | None
    verdict: Verdict
    upper: float | None
    layers: list[LayerBound]
    method: str
    reason: str | None = None
    # local bounds: {"kind": "ball", "norm", "eps", "center_sha256"}; None: the global domain
    domain: dict[str, Any] | None = None

    @property
    def lipschitz(self) -> bool | None:
        """True: certified finite constant. False: not Lipschitz on the domain. None: unknown."""
        return {"certified": True, "not_lipschitz": False}.get(self.verdict)
