"""lsa_models results -> api_schemas wire objects (the one place the two meet)."""

from __future__ import annotations

from api_schemas import BoundReport, LayerBoundOut
from lsa_models import __version__
from lsa_models.bounds import BoundResult


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
