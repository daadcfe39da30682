"""A model loaded from uploaded bytes, ready for analysis: what every format's loader returns.

Each format has its own subclass that certifies itself (`analysis.NativeModel` through the
native bound rules, `onnx.OnnxLoadedModel` through the ONNX graph analyser), so callers never
ask which format they hold.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .bounds import BoundResult
from .bounds.report import NormName

DEFAULT_SEQ_LEN = 128


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class LoadedModel(ABC):
    """`module` maps (B, N, D) -> (B, N, D') and is what empirical searches run."""

    format: str  # "native" | "onnx" | "onnx-zip"
    sha256: str
    module: nn.Module
    summary: dict[str, Any] = field(default_factory=dict)
    # Graph models fix N in their input shape; None: the caller must choose.
    seq_len: int | None = None
    # Token width D of the continuous input (B, N, D).
    d_model: int | None = None

    @abstractmethod
    def certify(self, norm: NormName | float, seq_len: int | None = None,
                radius: float | None = None) -> BoundResult:
        """Certified bound at `seq_len` (`resolve_seq_len` picks it when None)."""

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


__all__ = ["DEFAULT_SEQ_LEN", "LoadedModel", "sha256_hex"]
