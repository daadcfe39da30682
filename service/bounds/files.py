"""Reports of a model file, as `lsa bound`, `lsa certify` and `lsa verify --recompute` compute
them: load the bytes, certify (globally: `compute_report`; on the ball around one input:
`local_report`), and with `EmpiricalOptions` search a lower bound too. Below the CLI modules
of every domain (each imports it; it imports none of them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from api_schemas import BoundReport


@dataclass(frozen=True)
class EmpiricalOptions:
    """`--empirical`: search a lower bound; the seed (with restarts, steps) reproduces it."""
    restarts: int = 4
    steps: int = 50
    seed: int = 0
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.restarts < 1:
            raise ValueError(f"--restarts must be >= 1, got {self.restarts}")
        if self.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"--time-budget must be > 0 seconds, got {self.time_budget_s}")


def compute_report(path: Path, norm: str, seq_len: int | None,
                   radius: float | None, *, empirical: EmpiricalOptions | None = None,
                   progress: Callable[[float, str], None] | None = None) -> BoundReport:
    """Load a model file and certify it; raises on bad input (callers turn that into exit 2).
    With `empirical`, also search a lower bound on the report's domain."""
    # Deferred: lsa_models and service.reports import torch (seconds; `lsa --help` needs none).
    from lsa_models.analysis import load_model_bytes
    from service.reports import bound_report, with_empirical

    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    data = path.read_bytes()
    loaded = load_model_bytes(data, path.name)
    result = loaded.certify(norm, seq_len, radius)  # type: ignore[arg-type]
    report = bound_report(result, loaded.sha256)
    if empirical is None:
        return report
    from lsa_models.empirical import estimate  # deferred: torch

    if loaded.d_model is None:
        raise ValueError(f"{path.name}: the model does not state its token width D; "
                         "--empirical needs it")
    try:
        est = estimate(loaded.module, input_shape=(report.seq_len, loaded.d_model), norm=norm,
                       restarts=empirical.restarts, steps=empirical.steps, seed=empirical.seed,
                       time_budget_s=empirical.time_budget_s, progress=progress, radius=radius)
    except RuntimeError as exc:  # the model itself failed on a search input
        raise ValueError(f"{path.name}: the empirical search failed: {exc}") from exc
    return with_empirical(report, est)


def local_report(path: Path, norm: str, at: Path, eps: float | None, *,
                 empirical: EmpiricalOptions | None = None) -> BoundReport:
    """The bound on the ball {X : ||X - X0||_norm <= eps}; `upper` is the local constant.
    With `empirical` (EmpiricalOptions), the in-ball projected-ascent lower bound too."""
    # Deferred: the ball's code imports the service's storage (SQLAlchemy), which `lsa bound`
    # without --at does not need.
    from ..kit.inputs import check_eps, load_center, load_model
    from .local import local_report_of, model_input

    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    e = check_eps(eps)
    x0 = load_center(at)
    loaded = load_model(path)
    x0 = model_input(loaded, x0, field="--at")
    return local_report_of(loaded, loaded.sha256, x0, e, norm, empirical=empirical)
