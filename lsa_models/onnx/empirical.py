"""Empirical lower bounds on ONNX models, through the torch evaluator, replayed on onnxruntime.

Any input X gives `||J(X)|| <= Lip`; projected gradient ascent on the exact Jacobian norm
(float64, small models) finds a good X. The witness is then replayed on onnxruntime, whose
Jacobian is estimated by central finite differences: an independent check that the torch
evaluation's number belongs to the uploaded graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..empirical.local import jacobian_norm
from ..empirical.search import project
from .loading import OnnxModel, ort_run

MAX_JACOBIAN_SIZE = 4096  # N * D; beyond it use matrix-free estimators


@dataclass
class OnnxLowerBound:
    lower: float
    witness: np.ndarray  # (N, D)
    norm: str
    seed: int


def lower_bound(model: OnnxModel, norm: str, seq_len: int, radius: float | None = None,
                restarts: int = 3, steps: int = 30, lr: float = 0.1,
                seed: int = 0) -> OnnxLowerBound:
    """Best `||J(X)||_norm` found by projected gradient ascent (tokens kept in the ball of
    the given radius). Exact Jacobians: for N * D up to MAX_JACOBIAN_SIZE."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    d = model.spec.d_model
    if seq_len * d > MAX_JACOBIAN_SIZE:
        raise ValueError(f"N * D = {seq_len * d} is too large for exact Jacobians "
                         f"(limit {MAX_JACOBIAN_SIZE})")
    f64 = model.module.with_dtype(torch.float64)

    def f(z: Tensor) -> Tensor:  # (N, D) -> flat output
        return f64(z[None]).reshape(-1)

    gen = torch.Generator().manual_seed(seed)
    best, best_x = -1.0, None
    for _ in range(restarts):
        x = torch.randn(seq_len, d, generator=gen, dtype=torch.float64)
        if radius is not None:
            x = project(x * radius, radius)
        x.requires_grad_(True)
        for step in range(steps + 1):
            jac = torch.autograd.functional.jacobian(f, x, create_graph=step < steps)
            val = jacobian_norm(jac.reshape(-1, seq_len * d), norm)
            value = float(val.detach())
            if value > best:
                best, best_x = value, x.detach().clone()
            if step == steps:
                break
            (g,) = torch.autograd.grad(val, x)
            with torch.no_grad():
                x += lr * g / (g.norm() + 1e-12) * max(float(x.norm()), 1.0)
                if radius is not None:
                    x.copy_(project(x, radius))
    assert best_x is not None
    return OnnxLowerBound(best, best_x.numpy(), norm, seed)


def jacobian_norm_torch(model: OnnxModel, x: np.ndarray, norm: str) -> float:
    f64 = model.module.with_dtype(torch.float64)
    xt = torch.from_numpy(np.asarray(x, dtype=np.float64))
    jac = torch.autograd.functional.jacobian(lambda z: f64(z[None]).reshape(-1), xt)
    return float(jacobian_norm(jac.reshape(-1, xt.numel()), norm))


def replay_on_onnxruntime(model: OnnxModel, x: np.ndarray, norm: str,
                          h: float = 1e-4) -> float:
    """`||J(X)||_norm` of the graph on onnxruntime by central finite differences (float32)."""
    n, d = x.shape
    cols = []
    base = np.asarray(x, dtype=np.float64)
    for k in range(n * d):
        e = np.zeros(n * d)
        e[k] = h
        e = e.reshape(n, d)
        plus = ort_run(model.spec, (base + e)[None]).astype(np.float64).reshape(-1)
        minus = ort_run(model.spec, (base - e)[None]).astype(np.float64).reshape(-1)
        cols.append((plus - minus) / (2 * h))
    jac = np.stack(cols, axis=1)
    if norm == "2":
        return float(np.linalg.norm(jac, 2))
    return float(np.abs(jac).sum(axis=1).max())
