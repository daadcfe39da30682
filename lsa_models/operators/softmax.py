"""Softmax as one class owning every mode (operators/base.py): p = softmax(z) along `axis`,
J = diag(p) - p p^T per row. Derivations: docs/operators.md, "Softmax and LayerNorm", and
docs/local-enclosure.md.

Every range works on the last axis (the engine's rules move the softmax axis there); `axis`
is the node's, normalised by the caller where a graph is built from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..bounds.numerics import sqrt_up
from .arithmetic import Exp
from .base import GraphBuilder, Iv, Operator

# ||diag(p) - p p^T|| <= 1/2 in the 2- and inf-norms: the global Lipschitz factor
LIPSCHITZ = 0.5
# the enclosures' absolute floor (engine/values.FLOOR: 2^-600, a power of two)
FLOOR = 2.0**-600


class Softmax(Operator):
    """p = e^z / sum e^z along the attribute `axis` (-1 by default)."""

    types = ("Softmax",)

    def __init__(self, op_type: str, attrs: Mapping[str, Any] | None = None) -> None:
        super().__init__(op_type, attrs)
        self.axis = int(self.attrs.get("axis", -1))  # type: ignore[call-overload]

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.softmax(x, dim=self.axis)

    def global_factor(self) -> float:
        return LIPSCHITZ

    def token_radius(self, radius: float | None, width: int, rank: int = 0) -> float | None:
        """A row along the softmax axis (the last of `rank`) has 2-norm <= 1 (probabilities);
        any other row of `width` entries in [0, 1] at most sqrt(width)."""
        last = self.axis % max(rank, 1) == rank - 1
        return 1.0 if last else sqrt_up(width)

    def point(self, x: np.ndarray) -> np.ndarray:
        """p in float64 over the last axis (the property tests' reference)."""
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def jacobian_center(self, pc: np.ndarray) -> np.ndarray:
        """S = diag(p) - p p^T (..., n, n) at the computed centre's probabilities pc (..., n)."""
        n = pc.shape[-1]
        return np.einsum("...i,ij->...ij", pc, np.eye(n)) - pc[..., :, None] * pc[..., None, :]

    def probability_ranges(self, lo: np.ndarray, hi: np.ndarray, pc: np.ndarray) -> Iv:
        """Probability ranges over the last axis from logit ranges [lo, hi] (..., n), widened to
        contain the centre's pc: p_i >= e^lo_i / (e^lo_i + sum_{j != i} e^hi_j) and the
        mirror, the sums formed by a product with (1 - I) (positive terms, no cancellation)."""
        n = lo.shape[-1]
        m = hi.max(axis=-1, keepdims=True)
        elo, ehi = np.exp(lo - m), np.exp(hi - m)
        off = 1.0 - np.eye(n)
        plo = elo / (elo + ehi @ off)
        phi = ehi / (ehi + elo @ off)
        plo = np.clip(plo * (1 - 8 * (n + 4) * 1e-16) - 1e-300, 0.0, 1.0)
        phi = np.clip(phi * (1 + 8 * (n + 4) * 1e-16) + 1e-300, 0.0, 1.0)
        return np.minimum(plo, pc), np.maximum(phi, pc)

    def jacobian_ranges(self, lo: np.ndarray, hi: np.ndarray, pc: np.ndarray, sc: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(plo, phi, sr): the probability ranges from logit ranges (..., n), and the radius
        (..., n, n) of S = diag(p) - p p^T's entries around sc over them: the diagonal
        q - q^2 is concave (its maximum 1/4 where the range holds 1/2), the off-diagonal
        -p_i p_j monotone in each factor."""
        n = lo.shape[-1]
        plo, phi = self.probability_ranges(lo, hi, pc)
        q = lambda x: x - x * x  # noqa: E731
        dmax = np.where((plo <= 0.5) & (phi >= 0.5), 0.25, np.maximum(q(plo), q(phi)))
        dmin = np.minimum(q(plo), q(phi))
        omax = -plo[..., :, None] * plo[..., None, :]
        omin = -phi[..., :, None] * phi[..., None, :]
        eye = np.eye(n, dtype=bool)
        smax = np.where(eye, dmax[..., :, None] * np.ones(n), omax)
        smin = np.where(eye, dmin[..., :, None] * np.ones(n), omin)
        sr = np.maximum(np.maximum(smax - sc, sc - smin), 0.0) * (1 + 1e-12) + FLOOR
        return plo, phi, sr

    def difference_probability_ranges(self, dlo: np.ndarray, dhi: np.ndarray) -> Iv:
        """Probability ranges from ranges of the logits' differences, dlo_ij <= z_j - z_i <=
        dhi_ij (..., n, n), row i (the diagonal read as 0): p_i = 1 / sum_j e^(z_j - z_i), so
        1 / sum_j e^dhi_ij <= p_i <= 1 / sum_j e^dlo_ij. Shared terms of the logits cancel in
        their differences, so these are narrower than the box's wherever the logits move
        together."""
        n = dlo.shape[-1]
        eye = np.eye(n, dtype=bool)
        with np.errstate(over="ignore"):
            shi = np.exp(np.where(eye, 0.0, dhi)).sum(axis=-1)
            slo = np.exp(np.where(eye, 0.0, dlo)).sum(axis=-1)
        # the same allowance for exp's and the sum's roundings as `probability_ranges`
        plo = np.clip((1.0 / shi) * (1 - 8 * (n + 4) * 1e-16) - 1e-300, 0.0, 1.0)
        phi = np.clip((1.0 / slo) * (1 + 8 * (n + 4) * 1e-16) + 1e-300, 0.0, 1.0)
        return plo, phi

    def jacobian_midpoints(self, plo: np.ndarray, phi: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A Jacobian to expand about when the probabilities only lie in [plo, phi] (..., n):
        (sc, off, full, resid). Off the diagonal sc_ij is the midpoint of
        J_ij = -p_i p_j in [-phi_i phi_j, -plo_i plo_j] and `off` (zero on the diagonal) its
        radius; sc_ii closes the row's sum (J's rows sum to 0), `full` adds the diagonal's
        radius about it (J_ii = p_i - p_i^2 is concave); resid >= |sum_j sc_ij| (the row sum
        as the floats hold it). Every radius with 4u of its terms' magnitudes for the
        roundings of the products and differences."""
        n = plo.shape[-1]
        eye = np.eye(n, dtype=bool)
        lo2 = plo[..., :, None] * plo[..., None, :]
        hi2 = phi[..., :, None] * phi[..., None, :]
        sc = np.where(eye, 0.0, -0.5 * (lo2 + hi2))
        diag = -sc.sum(axis=-1)
        sc = sc + diag[..., :, None] * eye
        u4 = 4 * 2.0**-53
        off = np.maximum(sc + hi2, -lo2 - sc) * (1 + u4) + u4 * (np.abs(sc) + hi2)
        off = np.where(eye, 0.0, np.maximum(off, 0.0) + FLOOR)
        q = lambda x: x - x * x  # noqa: E731
        dmax = np.where((plo <= 0.5) & (phi >= 0.5), 0.25, np.maximum(q(plo), q(phi)))
        dmin = np.minimum(q(plo), q(phi))
        rdiag = np.maximum(np.maximum(dmax - diag, diag - dmin), 0.0) * (1 + u4) \
            + u4 * (np.abs(diag) + 1.0) + FLOOR
        full = np.where(eye, rdiag[..., :, None], off)
        asum = np.abs(sc).sum(axis=-1)
        resid = np.abs(sc.sum(axis=-1)) + 2 * (n + 2) * 2.0**-53 * asum * (1 + 1e-12) + FLOOR
        return sc, off, full, resid

    def scaled_derivative(self, b: GraphBuilder, g: str, x: str, y: str,
                          derivative_first: bool) -> str:
        """J g = y (g - sum(y g)) along the axis (J symmetric: the tangent's and the adjoint's
        product alike; `derivative_first`: y g, else g y, as each graph has always written
        it). The axis must be normalised (>= 0)."""
        if self.axis < 0:
            self.refuse("tangent/adjoint", "the axis is not normalised")
        yg = b.op("Mul", [y, g] if derivative_first else [g, y])
        s = b.op("ReduceSum", [yg, b.ints([self.axis])], {"keepdims": 1})
        return b.op("Mul", [y, b.op("Sub", [g, s])])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        """Softmax of an object array of balls (not entrywise): e^z over the sum along the
        axis, e^z ball by ball."""
        ex = Exp("Exp").arb(arb)

        def f(x: Any) -> Any:
            e = np.asarray(np.frompyfunc(ex, 1, 1)(x), dtype=object)
            return np.asarray(e / np.sum(e, axis=self.axis % x.ndim, keepdims=True),
                              dtype=object)
        return f


__all__ = ["FLOOR", "LIPSCHITZ", "Softmax"]
