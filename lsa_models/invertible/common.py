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


# Power steps on each Gram matrix G: the estimate is `G^_POWER e_j`, e_j the basis vector
# of G's largest column, so the Rayleigh quotient's error is ~ (l2/l1)^(2 _POWER)
# (l = eigenvalues of G). Matrix-vector products (k^2 each) rather than squarings of G
# (k^3 each): at k = 64 sixteen of them cost a sixteenth of the four squarings to G^16.
_POWER = 16
_RENORM_EVERY = 3


def _dominant_vectors(grams: Tensor) -> Tensor:  # (S, k, k) -> (S, k, 1)
    """Unit estimates of the dominant eigenvector of each PSD matrix: `G^_POWER e_j` with
    j the largest column. G is divided by its trace first (every eigenvalue <= 1, the
    largest >= 1/k) and the vector renormalised every `_RENORM_EVERY` steps, so its entries
    stay far inside float32's range with few normalisations."""
    g = grams / (grams.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None] + 1e-30)
    k = g.shape[-1]
    v = g.gather(-1, g.norm(dim=-2).argmax(-1)[:, None, None].expand(-1, k, 1))  # (S, k, 1)
    for i in range(1, _POWER):
        if i % _RENORM_EVERY == 0:
            v = v / v.norm(dim=-2, keepdim=True).clamp_min(1e-30)
        v = _matvec(g, v)  # (S, k, 1)
    return v / v.norm(dim=-2, keepdim=True).clamp_min(1e-30)


def _matvec(a: Tensor, v: Tensor) -> Tensor:  # (S, m, k), (S, k, 1) -> (S, m, 1)
    # A broadcast product and a row sum: on CPU several times faster than bmm, whose
    # one-column products go through a general matrix kernel batch by batch.
    return (a * v.mT).sum(-1, keepdim=True)


def estimate_norms(mats: list[Tensor]) -> list[Tensor]:
    """Largest singular value of each matrix in each (..., m, n) stack: shape (...) each.

    Stateless and deterministic in the weights (so a resumed training run repeats the
    uninterrupted one bit for bit): each matrix is oriented tall (`W^T` when it is wider than
    tall), `_POWER` power steps on the Gram matrix `W^T W` of its short side
    (`_dominant_vectors`) give the dominant right singular vector estimate v, and `sigma = ||W v||` (v a unit vector) is a Rayleigh quotient, `<=` the true norm,
    differentiable in W with gradient `u v^T`, the gradient of `||W||_2` at convergence.
    Grams of one size share one batched chain of products, and matrices of one oriented shape
    one batched Rayleigh quotient, so a whole `ContractiveTrunk` (16 matrices at D=64, four
    layers) costs a few kernels. Estimates only: they drive the contractive rescale during
    training, never a certified number. Autocast is off inside (float32 throughout).
    """
    if not mats:
        return []
    tall = [w.mT if w.shape[-1] > w.shape[-2] else w for w in mats]
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, w in enumerate(tall):
        shapes.setdefault((w.shape[-2], w.shape[-1]), []).append(i)
    with torch.autocast(mats[0].device.type, enabled=False):
        stacks = {mk: torch.cat([tall[i].reshape(-1, *mk) for i in idx])  # (S, m, k)
                  for mk, idx in shapes.items()}
        with torch.no_grad():
            by_k: dict[int, list[tuple[int, int]]] = {}
            for mk in stacks:
                by_k.setdefault(mk[1], []).append(mk)
            vectors: dict[tuple[int, int], Tensor] = {}
            for mks in by_k.values():
                grams = torch.cat([stacks[mk].detach().mT @ stacks[mk].detach()
                                   for mk in mks])  # (S, k, k)
                v = _dominant_vectors(grams)  # (S, k, 1)
                for mk, part in zip(mks, v.split([stacks[mk].shape[0] for mk in mks]),
                                    strict=True):
                    vectors[mk] = part
        out: list[Tensor | None] = [None] * len(mats)
        for mk, idx in shapes.items():
            sigma = _matvec(stacks[mk], vectors[mk]).squeeze(-1).norm(dim=-1)  # (S,): ||W v||
            counts = [math.prod(mats[i].shape[:-2]) for i in idx]
            for i, part in zip(idx, sigma.split(counts), strict=True):
                out[i] = part.reshape(mats[i].shape[:-2])
    return [o for o in out if o is not None]


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
