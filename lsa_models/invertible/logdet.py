"""Hutchinson power-series estimate of `log det(I + J_g)` for a contractive branch."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def logdet_estimate(g: Callable[[Tensor], Tensor], x: Tensor, n_terms: int = 10,
                    n_samples: int = 16, lipschitz: float | None = None,
                    generator: torch.Generator | None = None) -> LogDetEstimate:
    """Estimate `log det(I + J_g(x))` per sequence by the power series
    `sum_{k=1}^{n_terms} (-1)^{k+1} tr(J_g^k) / k` with Hutchinson traces `v^T J^k v`
    (Rademacher v; `v^T J^k` by repeated vector-Jacobian products).

    Returns the mean over `n_samples` probes, its standard error, and (given the branch's
    Lipschitz constant c < 1) a bound on the truncation bias,
    `|sum_{k>n} tr(J^k)/k| <= ND c^{n+1} / ((n+1)(1-c))`. The series converges only when
    the spectral radius of J_g is < 1, which Lip(g) < 1 guarantees.
    """
    if n_terms < 1 or n_samples < 2:
        raise ValueError("n_terms must be >= 1 and n_samples >= 2")
    b = x.shape[0]
    # All probes in one batch: g acts on each sequence separately, so repeating x along the
    # batch gives every probe its own copy of J and one vjp per term serves them all.
    x_rep = x.detach().repeat(n_samples, *([1] * (x.dim() - 1)))  # (S*B, N, D)
    _, vjp_fn = torch.func.vjp(g, x_rep)[:2]
    v = torch.randint(0, 2, x_rep.shape, generator=generator, dtype=torch.int64,
                      device="cpu").to(device=x.device, dtype=x.dtype) * 2 - 1  # (S*B, N, D)
    w = v
    est = torch.zeros(x_rep.shape[0], dtype=x.dtype, device=x.device)  # (S*B,)
    for k in range(1, n_terms + 1):
        w = vjp_fn(w)[0]  # v^T J^k, (S*B, N, D)
        est = est + ((-1.0) ** (k + 1)) * (w * v).flatten(1).sum(1) / k
    s = est.view(n_samples, b)  # (S, B)
    mean = s.mean(0)
    stderr = s.std(0, unbiased=True) / math.sqrt(n_samples)
    trunc = math.inf
    if lipschitz is not None and lipschitz < 1.0:
        nd = x[0].numel()
        trunc = nd * lipschitz ** (n_terms + 1) / ((n_terms + 1) * (1.0 - lipschitz))
    return LogDetEstimate(mean.detach(), stderr.detach(), trunc, n_terms, n_samples)


@dataclass
class LogDetEstimate:
    value: Tensor  # (B,)
    stderr: Tensor  # (B,)
    truncation_bound: float
    n_terms: int
    n_samples: int
