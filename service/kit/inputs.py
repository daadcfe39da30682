"""The inputs the CLI's local commands read (`lsa bound --at`, `lsa robustness`, `lsa verify
--recompute`): .npy arrays (never pickles), labels, the model file, and the radius and eps
options, each refused with a message naming the option and how to fix it (ValueError)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def _load_npy(path: Path, option: str, holds: str) -> np.ndarray:
    """An array from a .npy file (no pickles: object arrays are refused)."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file ({option} takes a .npy file holding {holds})")
    with path.open("rb") as fh:
        magic = fh.read(6)
    if magic != b"\x93NUMPY":
        raise ValueError(f"{path}: not a .npy file ({option} takes one holding {holds}: "
                         "write it with numpy.save)")
    try:
        return np.asarray(np.load(path, allow_pickle=False))
    except ValueError as exc:
        if "pickle" in str(exc) or "object" in str(exc):
            # never loaded: an object array is a pickle (docs: no untrusted deserialisation)
            raise ValueError(f"{path}: holds Python objects (a pickle), which lsa does not "
                             f"load; save a numeric array ({holds}) with numpy.save") from None
        raise ValueError(f"{path}: not a readable .npy array ({exc}); write it with "
                         "numpy.save") from None
    except OSError as exc:
        raise ValueError(f"{path}: not a readable .npy array ({exc}); write it with "
                         "numpy.save") from None


def load_center(path: Path, option: str = "--at", holds: str = "one input") -> np.ndarray:
    """X0 from a .npy file, as float64."""
    x = _load_npy(path, option, holds)
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{path}: the array has dtype {x.dtype}; a float array is needed")
    return np.asarray(x, dtype=np.float64)


def check_eps(eps: float | None) -> float:
    if eps is None:
        raise ValueError("--at needs --eps E: the radius of the ball around the input")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"--eps must be finite and >= 0, got {eps}")
    return eps


def load_model(path: Path) -> Any:
    # Deferred here and below: lsa_models imports torch (seconds; `lsa --help` needs none).
    from lsa_models.analysis import load_model_bytes

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    return load_model_bytes(path.read_bytes(), path.name)


def check_radius(radius: float) -> float:
    if not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"--radius must be finite and > 0, got {radius}")
    return radius


def load_labels(path: Path) -> np.ndarray:
    """The labels from a .npy file: one integer class index per input (integral floats are
    accepted)."""
    y = _load_npy(path, "--labels", "one integer label per input")
    if not np.issubdtype(y.dtype, np.integer):
        if not (np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y))
                and np.all(y == np.round(y))):
            raise ValueError(f"{path}: labels must be integer class indices, got dtype "
                             f"{y.dtype}")
        y = y.astype(np.int64)
    if y.ndim != 1:
        raise ValueError(f"{path}: labels must be a 1-D array (one per input), got shape "
                         f"{tuple(y.shape)}")
    return y
