"""One entry point from uploaded bytes to a bound: detect the format, load safely, certify.

Formats are detected from content, never trusted from the file name alone, and tried in a
fixed order: native safetensors checkpoints (structural sniffing: header length + JSON), then
ONNX graphs and zips of a graph with its external data (`lsa_models.onnx`). The loaded model
certifies itself (`LoadedModel.certify`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .bounds import BoundResult, certify
from .bounds.report import NormName
from .checkpoint import from_bytes, read_metadata
from .loaded import LoadedModel, sha256_hex
from .onnx import is_onnx, load_onnx_model


class ModelFormatError(ValueError):
    """The bytes are not a model format the service reads."""


@dataclass
class NativeModel(LoadedModel):
    """A native checkpoint (its continuous part, for language models)."""

    def certify(self, norm: NormName | float, seq_len: int | None = None,
                radius: float | None = None) -> BoundResult:
        return certify(self.module, norm, self.resolve_seq_len(seq_len), radius)


def _is_safetensors(data: bytes, filename: str) -> bool:
    if len(data) < 10:
        return False
    n = int.from_bytes(data[:8], "little")
    return 0 < n <= len(data) - 8 and data[8:9] == b"{"


def load_native(data: bytes, filename: str = "") -> NativeModel:
    meta = read_metadata(data)
    module = from_bytes(data)
    # Models over discrete tokens (language models) are analysed after their embedding.
    continuous = getattr(module, "continuous_part", None)
    if callable(continuous):
        module = continuous()
    d_model = getattr(module.config, "d_model", None)
    summary = {
        "kind": meta.get("kind"),
        "config": module.config.__dict__ if hasattr(module, "config") else {},
        "parameters": sum(p.numel() for p in module.parameters()),
        "d_model": d_model,
    }
    return NativeModel("native", sha256_hex(data), module, _jsonable(summary), d_model=d_model)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(obj.__dict__)
    return obj


Loader = Callable[[bytes, str], LoadedModel]
# (sniff(data, filename) -> bool, loader), tried in this order: the native sniffing is
# structural, the ONNX one accepts any protobuf that parses as a graph.
LOADERS: tuple[tuple[Callable[[bytes, str], bool], Loader], ...] = (
    (_is_safetensors, load_native),
    (is_onnx, load_onnx_model),
)


def load_model_bytes(data: bytes, filename: str = "") -> LoadedModel:
    """Load an upload. Raises ModelFormatError / CheckpointError / the ONNX errors."""
    for sniff, loader in LOADERS:
        if sniff(data, filename):
            return loader(data, filename)
    raise ModelFormatError(f"unrecognised model file {filename or ''!s}: expected a native "
                           ".safetensors checkpoint (lsa_models.save), an .onnx graph, or a "
                           ".zip of an .onnx with its external data")


__all__ = ["LOADERS", "ModelFormatError", "NativeModel", "load_model_bytes", "load_native",
           "sha256_hex"]
