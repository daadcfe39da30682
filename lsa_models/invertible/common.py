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
from ..config import AttentionConfig, ConfigError, _positive_int

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
    exact but slow; the training path uses `estimate.estimate_norms` instead)."""
    return torch.linalg.matrix_norm(w.float(), ord=2)


@dataclass(frozen=True)
class ContractiveL2Config:
    d_model: int
    n_heads: int
    max_len: int
    c: float = 0.9
    causal: bool = True

    def __post_init__(self) -> None:
        AttentionConfig(self.d_model, self.n_heads, "l2", True, self.causal)  # validates
        _positive_int("max_len", self.max_len)
        _check_c(self.c)


@dataclass(frozen=True)
class ContractiveFFNConfig:
    d_model: int
    d_ff: int
    c: float = 0.9
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = "relu"

    def __post_init__(self) -> None:
        _positive_int("d_model", self.d_model)
        _positive_int("d_ff", self.d_ff)
        if self.activation not in ACTIVATION_LIPSCHITZ:
            raise ConfigError("activation", f"unknown activation {self.activation!r}; use one "
                              f"of {', '.join(ACTIVATION_LIPSCHITZ)}")
        _check_c(self.c)
