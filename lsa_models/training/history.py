"""What a training run records step by step, and the one progress protocol."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Progress:
    """One progress report. `fraction` in [0, 1]; `stage` names the phase ("loading corpus",
    "training", "evaluating", "certifying", "exporting", "done"); training reports carry the
    step, the loss of that step (nats/char) and the throughput of the interval."""

    fraction: float
    stage: str
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None

    @property
    def bpc(self) -> float | None:
        return None if self.loss is None else self.loss / LN2


# The one callback signature of `train_lm` and `train_certified`.
ProgressCallback = Callable[[Progress], None]


@dataclass
class History:
    """Per-step training loss (nats/char), learning rate, validation bpc, throughput."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val_step: list[int] = field(default_factory=list)
    val_bpc: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    divergence_events: int = 0
    diverged: bool = False  # a non-finite loss stopped the run
    # Divergence-event detector state, kept here so that it survives a resume.
    ema: float | None = None
    best_ema: float | None = None
    in_spike: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        return cls(**data)

    def record(self, step: int, loss: float, lr: float) -> None:
        self.step.append(step)
        self.loss.append(loss)
        self.lr.append(lr)

    def observe(self, loss: float, spike_nats: float) -> None:
        """Count divergence events: a non-finite loss, or a jump of more than `spike_nats`
        above the best smoothed (EMA 0.1) loss; one event lasts until the loss comes back
        within half that margin."""
        if not math.isfinite(loss):
            self.divergence_events += 1
            self.diverged = True
            return
        if self.best_ema is not None:
            if not self.in_spike and loss > self.best_ema + spike_nats:
                self.divergence_events += 1
                self.in_spike = True
            elif self.in_spike and loss < self.best_ema + spike_nats / 2:
                self.in_spike = False
        self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        if len(self.loss) >= 20:  # skip the initial transient
            self.best_ema = self.ema if self.best_ema is None else min(self.best_ema, self.ema)


__all__ = ["LN2", "History", "Progress", "ProgressCallback"]
