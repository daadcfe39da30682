"""lsa_models results -> api_schemas wire objects (the one place the two meet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from api_schemas import BoundReport, LayerBoundOut
from api_schemas.bounds import GrowthPoint, Witness
from lsa_models import __version__
from lsa_models.bounds import BoundResult
from lsa_models.empirical import ratio

if TYPE_CHECKING:
    from lsa_models.empirical import EmpiricalResult


def bound_report(result: BoundResult, model_sha256: str) -> BoundReport:
    return BoundReport(
        model_sha256=model_sha256,
        norm=result.norm,
        seq_len=result.seq_len,
        radius=result.radius,
        lipschitz=result.lipschitz,
        verdict=result.verdict,
        upper=result.upper,
        reason=result.reason,
        layers=[
            LayerBoundOut(name=lb.name or "<model>", kind=lb.kind, upper=lb.upper,
                          status=lb.status, reason=lb.reason, nodes=list(lb.nodes))
            for lb in result.layers
        ],
        method=result.method,
        lsa_version=__version__,
    )


# Witness inputs up to this many numbers travel in the report; larger ones are reproduced from
# the seed (restarts, steps) instead of bloating every JSON answer.
MAX_WITNESS_VALUES = 65_536


def with_empirical(report: BoundReport, result: EmpiricalResult) -> BoundReport:
    """The report with `lower`, `ratio` (upper / lower) and `witness` from `estimate(...)`.

    Raises ValueError when the estimate does not belong to the report: another norm or N, or
    (bounded domain) a witness outside the report's radius, whose norm would not be a lower
    bound there; run `estimate(..., radius=report.radius)` for such reports.
    """
    n, d = result.input_shape
    if result.norm != report.norm:
        raise ValueError(f"the empirical estimate is for the {result.norm}-norm, the report for "
                         f"the {report.norm}-norm")
    if n != report.seq_len:
        raise ValueError(f"the empirical estimate is for N={n}, the report for "
                         f"N={report.seq_len}")
    witness = result.witness.detach().to(torch.float64)  # (N, D)
    if report.radius is not None:
        widest = float(witness.reshape(n, d).norm(dim=-1).max()) if witness.numel() else 0.0
        if widest > report.radius * (1 + 1e-5) + 1e-12:
            raise ValueError(
                f"the empirical witness has a token of 2-norm {widest:.6g}, outside the "
                f"report's radius {report.radius:g}: its Jacobian norm is no lower bound on that "
                f"domain; run estimate(..., radius={report.radius:g})")
    growth = None if result.growth is None else [
        GrowthPoint(scale=s, jacobian_norm=v) for s, v in result.growth]
    values = witness.reshape(-1)
    out = Witness(
        seed=result.seed,
        value=result.lower,
        input_shape=[n, d],
        input=values.tolist() if values.numel() <= MAX_WITNESS_VALUES else None,
        growth=growth,
        restarts=result.restarts,
        steps=result.steps,
        source=result.witness_source,
        scale=result.witness_scale,
        growth_exponent=result.growth_exponent,
    )
    return report.model_copy(update={"lower": result.lower,
                                     "ratio": ratio(report.upper, result.lower),
                                     "witness": out})
