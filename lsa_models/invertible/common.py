"""Shared pieces of the contractive blocks: configs, errors, the float32 scale rounding,
the cache key of the weights, and the N-dependent factor of the bound."""

from __future__ import annotations

import functools
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from ..bounds.formulas import _two_norm_lead
from ..bounds.numerics import ACTIVATION_LIPSCHITZ
from ..config import AttentionConfig, ConfigError

# The float32 scale is taken this much below c / U so that rounding c/U to float32 and then
# re-multiplying in upward-rounded float64 still certifies `<= c`.
_SCALE_MARGIN = 1.0 - 2.0**-20

InverseStatus = Literal["atol", "rtol", "max_iter", "diverged"]


class NonFiniteWeightsError(ValueError):
    """A contractive block's weights hold NaN or infinity (e.g. after a diverged step): no
    bound, hence no scale, exists."""


def _require_finite(params: list[Tensor], what: str) -> None:
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise NonFiniteWeightsError(f"{what}: weights contain NaN or infinity; no certified "
                                    "bound exists (the training run has diverged)")


def _check_c(c: float) -> None:
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0.0 < float(c) < 1.0:
        raise ConfigError("c", f"must satisfy 0 < c < 1 for a contractive branch, got {c!r}")


def _float32_down(x: float) -> float:
    """The largest float32 value <= x (x > 0)."""
    y = float(np.float32(x))
    if y > x:
        y = float(np.nextafter(np.float32(y), np.float32(0.0)))
    return y


def _outside_transforms() -> AbstractContextManager[object]:
    """Step out of torch.func transforms (jacrev, vjp): inside them even a parameter cannot be
    read into numpy, and the certified bound is a function of the weights alone."""
    try:
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    except ImportError:  # pragma: no cover - private API moved; plain eager mode still works
        return nullcontext()
    return temporarily_clear_interpreter_stack()  # type: ignore[no-any-return]


def _param_key(params: list[Tensor]) -> tuple[object, ...]:
    # `_version` moves on every in-place update (optimizer.step, load_state_dict), data_ptr
    # and dtype on .to()/.double(): together they say when the cached bound is stale.
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)


@functools.lru_cache(maxsize=256)
def _lead(n: int, causal: bool) -> float:
    """The N-dependent factor of the Theorem 3.2 2-norm bound (causal: root sum of squares of
    the prefix factors), as in `bounds.formulas.l2_mha_bound`; cached, it costs ~N Lambert Ws."""
    if causal:
        return math.sqrt(sum(_two_norm_lead(max(i, 2)) ** 2 for i in range(1, n + 1)))
    return _two_norm_lead(max(n, 2))


def _spec_norms(w: Tensor) -> Tensor:
    """Largest singular value of each matrix in a (..., m, n) stack, differentiable (an SVD:
    exact but slow; the training path uses `estimate_norms` instead)."""
    return torch.linalg.matrix_norm(w.float(), ord=2)


_SQUARINGS = 4  # Gram powers G^16: the Rayleigh quotient's error ~ (l2/l1)^32 (l = eigenvalues)


def estimate_norms(mats: list[Tensor]) -> list[Tensor]:
    """Largest singular value of each matrix in each (..., m, n) stack: shape (...) each.

    Stateless and deterministic in the weights (so a resumed training run repeats the
    uninterrupted one bit for bit): the Gram matrix of the smaller side is squared
    `_SQUARINGS` times (normalised), its largest column is the dominant singular vector
    estimate v, and `sigma = ||W v|| / ||v||` (or `||W^T v||` on the row side) is a Rayleigh
    quotient, `<=` the true norm, differentiable in W with gradient `u v^T`, the gradient of
    `||W||_2` at convergence. Grams of one size run in one batched product. Estimates only:
    they drive the contractive rescale during training, never a certified number.
    """
    grams: dict[int, list[tuple[int, Tensor]]] = {}
    with torch.no_grad():
        for i, w in enumerate(mats):
            wd = w.detach()
            g = wd.mT @ wd if wd.shape[-1] <= wd.shape[-2] else wd @ wd.mT  # (..., k, k)
            grams.setdefault(g.shape[-1], []).append((i, g.reshape(-1, *g.shape[-2:])))
        vectors: dict[int, Tensor] = {}
        for k, items in grams.items():
            p = torch.cat([g for _, g in items])  # (S, k, k)
            for _ in range(_SQUARINGS):
                # PSD: the largest entry is on the diagonal, so the amax is the diagonal's.
                p = p / (p.diagonal(dim1=-2, dim2=-1).amax(-1)[:, None, None] + 1e-30)
                p = p @ p  # (S, k, k)
            cols = p.norm(dim=-2)  # (S, k): column norms
            v = p.gather(-1, cols.argmax(-1)[:, None, None].expand(-1, k, 1))[..., 0]  # (S, k)
            v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
            start = 0
            for i, g in items:
                vectors[i] = v[start:start + g.shape[0]]
                start += g.shape[0]
    out = []
    for i, w in enumerate(mats):
        v = vectors[i].reshape(*w.shape[:-2], -1)  # (..., k)
        if w.shape[-1] <= w.shape[-2]:
            out.append((w @ v.unsqueeze(-1)).squeeze(-1).norm(dim=-1))  # ||W v||
        else:
            out.append((v.unsqueeze(-2) @ w).squeeze(-2).norm(dim=-1))  # ||W^T v||
    return out


@dataclass(frozen=True)
class ContractiveL2Config:
    d_model: int
    n_heads: int
    max_len: int
    c: float = 0.9
    causal: bool = True

    def __post_init__(self) -> None:
        AttentionConfig(self.d_model, self.n_heads, "l2", True, self.causal)  # validates
        if not isinstance(self.max_len, int) or isinstance(self.max_len, bool) \
                or self.max_len < 1:
            raise ConfigError("max_len", f"must be a positive integer, got {self.max_len!r}")
        _check_c(self.c)


@dataclass(frozen=True)
class ContractiveFFNConfig:
    d_model: int
    d_ff: int
    c: float = 0.9
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = "relu"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if self.activation not in ACTIVATION_LIPSCHITZ:
            raise ConfigError("activation", f"unknown activation {self.activation!r}; use one "
                              f"of {', '.join(ACTIVATION_LIPSCHITZ)}")
        _check_c(self.c)
