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
    # A fixed graph: the token counts a user may name for it (its input's N, and the N + 1 its
    # attention sees after a class token); any of them means the graph's own N
    seq_len_choices: tuple[int, ...] = ()

    @abstractmethod
    def certify(self, norm: NormName | float, seq_len: int | None = None,
                radius: float | None = None) -> BoundResult:
        """Certified bound at `seq_len` (`resolve_seq_len` picks it when None)."""

    def resolve_seq_len(self, seq_len: int | None) -> int:
        if seq_len is not None:
            return fixed_seq_len(seq_len, self.seq_len, self.seq_len_choices)
        if self.seq_len is not None:
            return self.seq_len
        default = getattr(self.module, "default_seq_len", None)
        return int(default) if default else DEFAULT_SEQ_LEN


def fixed_seq_len(seq_len: int, fixed: int | None, choices: tuple[int, ...] = ()) -> int:
    """The sequence length to analyse when a user names `seq_len`: itself for a dynamic graph;
    for a fixed one its own N when `seq_len` is N or a count its attention sees (`choices`:
    N + 1 with a class token), else ValueError saying which numbers it takes."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if fixed is None:
        return seq_len
    accepted = sorted({fixed, *choices})
    if seq_len in accepted:
        return fixed
    seen = [n for n in accepted if n != fixed]
    also = (f" and its attention sees {', '.join(map(str, seen))} (with a class token)"
            if seen else "")
    raise ValueError(f"seq_len={seq_len} does not fit this fixed-shape graph: its input has "
                     f"{fixed} tokens{also}; omit seq_len or give "
                     + (f"one of {', '.join(map(str, accepted))}" if seen else str(fixed)))


__all__ = ["DEFAULT_SEQ_LEN", "LoadedModel", "fixed_seq_len", "sha256_hex"]
