"""Uploaded models as the API describes them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MODEL_EXAMPLE: dict[str, Any] = {
    "id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
    "sha256": "9f2c" + "0" * 60,
    "format": "native",
    "filename": "tiny.safetensors",
    "size_bytes": 17672,
    "parameters": 3840,
    "default_seq_len": 128,
    "fixed_seq_len": None,
    "summary": {"kind": "transformer", "parameters": 3840, "d_model": 16,
                "config": {"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32}},
    "created_at": "2026-12-02T12:00:00Z",
}


class ModelOut(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [MODEL_EXAMPLE]})

    id: str
    sha256: str = Field(description="sha256 of the uploaded bytes (the model's identity)")
    format: str = Field(description="native | onnx | onnx-zip (detected from the content)")
    filename: str = Field(description="The name the file was uploaded under (informational)")
    size_bytes: int
    parameters: int | None = Field(default=None, description="Parameter count, if known")
    default_seq_len: int = Field(description="Sequence length N used when a request names none")
    fixed_seq_len: int | None = Field(
        default=None, description="N fixed by the model's input shape (graph models), if any")
    summary: dict[str, Any] = Field(description="Architecture summary from the loader")
    created_at: datetime


class ModelList(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"items": [MODEL_EXAMPLE], "total": 1}]},
    )

    items: list[ModelOut]
    total: int = Field(description="Number of models stored (all pages)")
