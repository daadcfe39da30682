"""The centre of the ball: the graph input X0 checked against the model's input shape, its
hash, and the float64 forward pass at X0 with its proven forward margin (rounding/forward_error.py),
shared by the Jacobian enclosure (drivers/jacobian.py) and the affine margins (drivers/margins.py).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from lsa_models.engine.rounding import forward_error
from lsa_models.onnx.loading import OnnxModel


def graph_input_shape(model: OnnxModel) -> tuple[int, ...]:
    spec = model.spec
    n = spec.seq_len
    if n is None:
        raise ValueError("the graph has a dynamic sequence length: local bounds need a "
                         "fixed one")
    if spec.rank == 2:
        return (n, spec.d_model)
    if spec.batch not in (None, 1):
        raise ValueError(f"the graph has a fixed batch size {spec.batch}; local bounds "
                         "need batch 1")
    return (1, n, spec.d_model)


def check_center(model: OnnxModel, x0: np.ndarray) -> np.ndarray:
    """X0 as the graph input (1, N, D) (or (N, D)); a leading batch dim of 1 allowed."""
    shape = graph_input_shape(model)
    x = np.asarray(x0)
    if not np.issubdtype(x.dtype, np.floating) and not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"the input must hold numbers, got dtype {x.dtype}")
    x = x.astype(np.float64)
    n, d = shape[-2], shape[-1]
    if x.shape not in ((n, d), (1, n, d)):
        raise ValueError(f"the input has shape {tuple(x.shape)}; the model takes one input "
                         f"of shape ({n}, {d}) (a leading batch dimension of 1 allowed)")
    if not np.all(np.isfinite(x)):
        raise ValueError("the input has non-finite entries")
    return x.reshape(shape)


def center_sha256(x0: np.ndarray) -> str:
    """Hash of the centre as float64 little-endian bytes in C order."""
    return hashlib.sha256(np.ascontiguousarray(x0, dtype="<f8").tobytes()).hexdigest()


def check_eps(eps: float) -> None:
    if not (eps >= 0 and np.isfinite(eps)):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")



class Centre(forward_error.Proven):
    """The float64 forward pass at X0 with its proven forward margin set (MARGIN, PROVEN) for
    the duration of a `with` block."""

    def __init__(self, model: OnnxModel, x: np.ndarray) -> None:
        self.module = model.module.with_dtype(torch.float64)
        with torch.no_grad():
            self.env = self.module.run_env(torch.from_numpy(x))
        super().__init__(list(self.module.runtime_nodes),  # type: ignore[arg-type]
                         model.spec.input_name, x, self.env)
