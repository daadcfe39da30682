"""The one error body every non-2xx response carries."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ErrorBody(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"error": "not_found",
             "detail": "no model with id 1b4e28ba-2fa1-11d2-883f-0016d3cca427"},
            {"error": "payload_too_large",
             "detail": "upload exceeds LSA_MAX_UPLOAD_BYTES=536870912"},
        ]},
    )

    error: str = Field(description="Machine-readable error code, e.g. not_found, invalid_model")
    detail: str = Field(description="What is wrong and how to fix it")
