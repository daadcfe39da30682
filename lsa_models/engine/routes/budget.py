"""A time budget for one input's radius search or decision (`local.robustness`,
`at_radius.decide`): a deadline on the monotonic clock, looked at between the stages of the
search (affine walks, attacks, sweep runs), never inside one. A stage that has started runs
to its end; a stage predicted to end past the deadline is not started: an affine walk from
the last walk timed on its graph (routes.plain_walk_seconds: a set's earlier input, or a
size-based estimate before any), times the cost ratio of its kind (Route.time_factor); a
sweep run on a ball from the last one, or before any (`sweep_run`) as routes.SWEEP_RUN_COST
plain walks. An input overruns its budget by at most a misprediction.

Stopping early, or skipping a stage, only loses tightness: each stage reports only what it
certified. A radius search stopped by its budget is a prefix of the same search without one
(the stages run in the same order, on the same inputs), so the radius it certified is at
most the unbudgeted one; a verdict at a radius under a budget runs the attack before the
walks, and reaches the unbudgeted verdict or none (a flip found and a certificate exclude
each other). A search that never found the budget spent is the unbudgeted search, to the
bit (at a radius, up to that order).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


def check_time_budget(seconds: float | None) -> float | None:
    """`seconds` as a budget (None: no budget); ValueError unless it is a finite number
    > 0."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"time_budget must be a finite number of seconds > 0 (or None: no "
                         f"budget), got {seconds!r}")
    return float(seconds)


@dataclass
class Budget:
    """The deadline of one input (monotonic seconds; inf: none) and where it stopped the
    search. `out(before)` is asked only where more work would follow: it records the first
    stage the budget kept from running."""

    deadline: float = math.inf
    seconds: float | None = None  # the budget as given
    stopped_before: str | None = None
    last: float = 0.0  # seconds of the last stage timed (`lap`): the next like one's cost
    predicted: float = 0.0  # > 0: stopped because the next stage would take this long
    # a sweep run's predicted seconds on a ball of positive radius (routes.sweep_passes):
    # the sweep's first run, at the centre, takes a fraction of one and predicts none
    sweep_run: float = 0.0

    @classmethod
    def start(cls, seconds: float | None) -> Budget:
        """A budget of `seconds` (checked; None: none) from now."""
        s = check_time_budget(seconds)
        if s is None:
            return cls()
        return cls(time.monotonic() + s, s)

    @property
    def timed(self) -> bool:
        """Whether there is a deadline (predictions are worth making)."""
        return self.deadline < math.inf

    @property
    def stopped(self) -> bool:
        return self.stopped_before is not None

    def out(self, before: str, cost: float = 0.0) -> bool:
        """Whether the budget is spent, or `cost` (the predicted seconds of the stage that
        would run next) would overrun it; if so, `before` (that stage) is recorded, once."""
        if self.stopped:
            return True
        if self.deadline < math.inf:
            now = time.monotonic()
            if now + cost >= self.deadline:
                self.stopped_before = before
                self.predicted = cost if now < self.deadline else 0.0
                return True
        return False

    def clock(self) -> float:
        """The budget's clock (monotonic seconds), to time a stage with."""
        return time.monotonic()

    def lap(self, started: float) -> None:
        """A stage begun at `started` (`clock()`) has ended: its seconds are `last`."""
        self.last = time.monotonic() - started

    def reason(self) -> str | None:
        """The budget's part in an unknown verdict or an early radius, in words."""
        if self.stopped_before is None:
            return None
        if self.predicted > 0:
            return (f"the time budget ({self.seconds:g} s) would run out in "
                    f"{self.stopped_before} (predicted {self.predicted:.3g} s)")
        return f"the time budget ({self.seconds:g} s) ran out before {self.stopped_before}"
