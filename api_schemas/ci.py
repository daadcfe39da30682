"""The report `lsa certify --json` writes: the signed certificate plus the bound behind it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .bounds import BoundReport
from .certificates import CERTIFICATE_EXAMPLE, Certificate

Outcome = Literal["passed", "failed"]

_BOUND_EXAMPLE: dict[str, Any] = BoundReport.model_json_schema()["examples"][0]

CERTIFY_REPORT_EXAMPLE: dict[str, Any] = {
    "model_file": "models/model.safetensors",
    "threshold": 1000.0,
    "outcome": "passed",
    "message": "certified Lipschitz bound 412.7 <= 1000 (2-norm, N=128)",
    "source": "server",
    "server": "https://lsa.example.org",
    "certificate": {**CERTIFICATE_EXAMPLE, "signature": "base64..."},
    "bound": _BOUND_EXAMPLE,
}


class CertifyReport(BaseModel):
    """One CI gate decision. `certificate` is exactly what `POST /certify` returns (or the
    locally signed equivalent); `bound` is exactly the `POST /bound` / `lsa bound --json`
    report it was derived from."""

    model_config = ConfigDict(extra="forbid",
                              json_schema_extra={"examples": [CERTIFY_REPORT_EXAMPLE]})

    model_file: str = Field(description="The model path as given on the command line")
    threshold: float = Field(description="--max-lipschitz")
    outcome: Outcome = Field(description="passed: certificate.passed; failed otherwise")
    message: str = Field(description="One line saying why")
    source: Literal["local", "server"]
    server: str | None = Field(default=None, description="Server URL when source=server")
    certificate: Certificate
    bound: BoundReport
