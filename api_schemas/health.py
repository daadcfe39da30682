"""Health and readiness."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Health(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"status": "ok", "checks": {"database": "ok",
                                                                    "broker": "ok"}}]},
    )

    status: Literal["ok"]
    checks: dict[str, str] = Field(default_factory=dict)
