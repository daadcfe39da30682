"""API keys (created with `lsa keys create`)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Scope = Literal["read", "write"]


class ApiKeyOut(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{
            "id": "0b7c2a8e-3c55-4a8e-9b7e-8d7f5d2e1a01", "prefix": "k3J9x2Qa",
            "scope": "write", "name": "ci", "created_at": "2026-12-02T12:00:00Z",
            "key": "lsa_k3J9x2Qa_...",
        }]},
    )

    id: str
    prefix: str = Field(description="Public part of the key, shown in listings")
    scope: Scope = Field(description="read: GET endpoints; write: everything")
    name: str | None = None
    created_at: datetime
    key: str | None = Field(default=None, description="The full key: shown once, at creation")

