"""The counterexamples behind a certified-accuracy certificate (GET
/certificates/{id}/counterexamples): the label flips its set's decision stored."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.certificates import Counterexamples

from ..deps import ReadAccess, RuntimeDep, in_thread
from ..errors import responses
from .service import counterexamples

router = APIRouter(tags=["certificates"])


@router.get("/certificates/{certificate_id}/counterexamples", response_model=Counterexamples,
            dependencies=[ReadAccess], responses=responses(404),
            summary="The label flips behind a certified-accuracy certificate (one per "
                    "attacked input: the point, its distance and class)")
@in_thread
def read_counterexamples(certificate_id: str, runtime: RuntimeDep) -> Counterexamples:
    return counterexamples(runtime, certificate_id)
