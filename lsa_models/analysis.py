"""One entry point from uploaded bytes to a bound: detect the format, load safely, certify.

Formats are detected from content, never trusted from the file name alone. Native safetensors
checkpoints are handled here; the ONNX loader registers itself in `LOADERS` (lsa_models.onnx).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .bounds import BoundResult, certify
from .bounds.report import NormName
from .checkpoint import CheckpointError, from_bytes, read_metadata

DEFAULT_SEQ_LEN = 128


class ModelFormatError(ValueError):
    """The bytes are not a model format the service reads."""


@dataclass
class LoadedModel:
    """A model ready for analysis. `module` maps (B, N, D) -> (B, N, D) for native models."""

    format: str  # "native" | "onnx" | "onnx-zip"
    sha256: str
    module: nn.Module
    summary: dict[str, Any] = field(default_factory=dict)
    # Graph models fix N in their input shape; None: the caller must choose.
    seq_len: int | None = None
    # Token width D of the continuous input (B, N, D).
    d_model: int | None = None
    # For formats with their own analyser (ONNX): (module, norm, seq_len, radius) -> result.
    certify_fn: Callable[[NormName, int, float | None], BoundResult] | None = None

    def certify(self, norm: NormName, seq_len: int | None = None,
                radius: float | None = None) -> BoundResult:
        n = self.resolve_seq_len(seq_len)
        if self.certify_fn is not None:
            return self.certify_fn(norm, n, radius)
        return certify(self.module, norm, n, radius)

    def resolve_seq_len(self, seq_len: int | None) -> int:
        if seq_len is not None:
            if seq_len < 1:
                raise ValueError(f"seq_len must be >= 1, got {seq_len}")
            if self.seq_len is not None and seq_len != self.seq_len:
                raise ValueError(f"seq_len={seq_len} differs from the model's fixed sequence "
                                 f"length {self.seq_len}")
            return seq_len
        if self.seq_len is not None:
            return self.seq_len
        default = getattr(self.module, "default_seq_len", None)
        return int(default) if default else DEFAULT_SEQ_LEN


Loader = Callable[[bytes, str], LoadedModel]
# (sniff(data, filename) -> bool, loader); tried in order.
LOADERS: list[tuple[Callable[[bytes, str], bool], Loader]] = []


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_safetensors(data: bytes, filename: str) -> bool:
    if len(data) < 10:
        return False
    n = int.from_bytes(data[:8], "little")
    return 0 < n <= len(data) - 8 and data[8:9] == b"{"


def load_native(data: bytes, filename: str = "") -> LoadedModel:
    meta = read_metadata(data)
    module = from_bytes(data)
    # Models over discrete tokens (language models) are analysed after their embedding.
    continuous = getattr(module, "continuous_part", None)
    if callable(continuous):
        module = continuous()
    d_model = getattr(module.config, "d_model", None)  # type: ignore[union-attr]
    summary = {
        "kind": meta.get("kind"),
        "config": module.config.__dict__ if hasattr(module, "config") else {},
        "parameters": sum(p.numel() for p in module.parameters()),
        "d_model": d_model,
    }
    return LoadedModel("native", sha256_hex(data), module, _jsonable(summary), d_model=d_model)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(obj.__dict__)
    return obj


LOADERS.append((_is_safetensors, load_native))


def load_model_bytes(data: bytes, filename: str = "") -> LoadedModel:
    """Load an upload. Raises ModelFormatError / CheckpointError / the ONNX errors."""
    for sniff, loader in LOADERS:
        if sniff(data, filename):
            return loader(data, filename)
    kinds = "a native .safetensors checkpoint (lsa_models.save)"
    if len(LOADERS) > 1:
        kinds += ", an .onnx graph, or a .zip of an .onnx with its external data"
    raise ModelFormatError(f"unrecognised model file {filename or ''!s}: expected {kinds}")


__all__ = [
    "DEFAULT_SEQ_LEN",
    "LOADERS",
    "CheckpointError",
    "LoadedModel",
    "ModelFormatError",
    "load_model_bytes",
    "load_native",
    "sha256_hex",
]

# The ONNX loader registers itself in LOADERS on import (after everything above exists).
from . import onnx as _onnx  # noqa: E402,F401
