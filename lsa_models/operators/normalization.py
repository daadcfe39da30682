"""LayerNormalization as one class owning every mode (operators/base.py): per token (the
axes from `axis` on; the local engines take the last axis only), u = x - mean x,
sigma = sqrt(||u||^2 / D + eps), z = u / sigma, y = gamma z + beta, and
dz/dx = S(x) = (1/sigma) (P - z z^T / D), P = I - 1 1^T / D. Derivations: docs/operators.md,
"Softmax and LayerNorm", and docs/local-enclosure.md ("LayerNorm directly").

RMSNorm is no ONNX op: its decomposed form is recognised (onnx/patterns.py); its global factor is
the Norm layer's (bounds/layer_graph/families.py, `rmsnorm_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..bounds.formulas import layernorm_bound
from .base import GraphBuilder, Iv, Operator

# relative allowance for the round-to-nearest float64 operations forming one interval end
# (a few operations per end, each within u = 1.1e-16 relative)
REL = 1e-12


def decimal_attr(x: float) -> float:
    """A float32 attribute read as the shortest decimal that rounds to it: the value the
    exporter was given (eps=1e-5 is stored as 9.99999974738e-06). The native analyser reads
    the configured value too; see docs/bounds.md, "Conventions"."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-")) \
        if abs(x) >= 1e-30 else float(x)


class LayerNormalization(Operator):
    """y = scale (x - mean x) / sqrt(var x + epsilon) + bias over the axes from `axis` on
    (ONNX LayerNormalization; `epsilon` 1e-5 by default, read by `decimal_attr`)."""

    types = ("LayerNormalization",)

    def __init__(self, op_type: str, attrs: Mapping[str, Any] | None = None) -> None:
        super().__init__(op_type, attrs)
        self.axis = int(self.attrs.get("axis", -1))  # type: ignore[call-overload]
        self.raw_eps = float(self.attrs.get("epsilon", 1e-5))  # type: ignore[arg-type]
        self.eps = decimal_attr(self.raw_eps)

    # evaluation and the global analysis
    def evaluate(self, x: Tensor, scale: Tensor | None = None,  # type: ignore[override]
                 bias: Tensor | None = None) -> Tensor:
        """The graph's value: torch's layer_norm at the float32 epsilon the graph holds."""
        ax = self.axis % x.dim()
        return torch.nn.functional.layer_norm(x, tuple(x.shape[ax:]), scale, bias,
                                              self.raw_eps)

    def lipschitz(self, scale: np.ndarray, norm: str, eps: float | None = None) -> float:
        """The global factor for a constant scale (docs/bounds.md, "LayerNorm"), rounded
        up, at the op's epsilon (or `eps`, the decomposed pattern's); refused for
        epsilon <= 0 (not Lipschitz)."""
        e = self.eps if eps is None else eps
        if e <= 0:
            self.refuse("global Lipschitz", "epsilon <= 0 is not Lipschitz")
        return layernorm_bound(scale, e, norm)

    # the Jacobian enclosure's pieces (last axis, D entries per token)
    @staticmethod
    def variance_range(norm0: np.ndarray, rho: np.ndarray, d: int, eps: float) -> Iv:
        """sigma^2 = ||u||^2 / D + eps over ||u|| in [norm0 - rho, norm0 + rho] (..., 1)."""
        slack = REL * (np.square(norm0 + rho) / d + eps)
        s_lo = np.maximum(np.square(np.maximum(norm0 - rho, 0.0)) / d + eps - slack,
                          eps * (1 - REL))
        s_hi = np.square(norm0 + rho) / d + eps + slack
        return s_lo, s_hi

    @staticmethod
    def jacobian_ranges(u_lo: np.ndarray, u_hi: np.ndarray, s_lo: np.ndarray,
                        s_hi: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """From u in [u_lo, u_hi] (..., D) and sigma^2 in [s_lo, s_hi] (..., 1): the interval
        [lo, hi] of every entry of S (..., D, D), the magnitude of the terms forming them (for
        rounding: REL of it), and z's interval (2, ..., D)."""
        d = u_lo.shape[-1]
        w_lo = 1.0 / np.sqrt(s_hi) * (1 - REL)  # 1/sigma, outward
        w_hi = 1.0 / np.sqrt(s_lo) * (1 + REL)
        # z = u w with w > 0: the ends are u_lo w_hi or u_lo w_lo (and likewise for u_hi)
        z_lo = np.minimum(u_lo * w_lo, u_lo * w_hi)
        z_hi = np.maximum(u_hi * w_lo, u_hi * w_hi)
        lim = np.sqrt(d) * (1 + REL)  # ||z||^2 = D ||u||^2 / (||u||^2 + D eps) < D
        z_lo = np.clip(z_lo - REL * np.abs(z_lo), -lim, lim)
        z_hi = np.clip(z_hi + REL * np.abs(z_hi), -lim, lim)
        # z_i z_j: interval product; the diagonal z_i^2 >= 0
        cands = np.stack([z_lo[..., :, None] * z_lo[..., None, :],
                          z_lo[..., :, None] * z_hi[..., None, :],
                          z_hi[..., :, None] * z_lo[..., None, :],
                          z_hi[..., :, None] * z_hi[..., None, :]])
        zz_lo, zz_hi = cands.min(axis=0), cands.max(axis=0)
        eye = np.eye(d, dtype=bool)
        across = (z_lo <= 0) & (z_hi >= 0)
        diag_lo = np.where(across, 0.0, np.minimum(z_lo * z_lo, z_hi * z_hi))
        zz_lo = np.where(eye, diag_lo[..., :, None], zz_lo)
        pm = np.eye(d) - 1.0 / d
        q_lo = pm - zz_hi / d  # P_ij - z_i z_j / D
        q_hi = pm - zz_lo / d
        wl, wh = w_lo[..., None], w_hi[..., None]  # (..., 1, 1)
        s_entry_lo = np.minimum(wl * q_lo, wh * q_lo)
        s_entry_hi = np.maximum(wl * q_hi, wh * q_hi)
        mag = wh * (np.abs(pm) + np.maximum(np.abs(zz_lo), np.abs(zz_hi)) / d)
        return s_entry_lo, s_entry_hi, mag, np.stack([z_lo, z_hi])

    @staticmethod
    def jacobian_center(uc: np.ndarray, sc: np.ndarray) -> np.ndarray:
        """S(X0) = (1/sigma)(P - z z^T / D) per token, float64 (rounding: REL of `mag`)."""
        d = uc.shape[-1]
        wc = 1.0 / np.sqrt(sc)  # (..., 1)
        zc = uc * wc  # (..., D)
        pm = np.eye(d) - 1.0 / d
        return wc[..., None] * (pm - zc[..., :, None] * zc[..., None, :] / d)

    def output_range(self, uc: np.ndarray, ru: np.ndarray, g: np.ndarray,
                     b: np.ndarray | None) -> Iv:
        """y's range per entry from u = P x within uc +- ru (..., D) (ru covering the
        centring's rounding): sigma^2 from the token's centred norm +- ||ru||, z's interval,
        then gamma z + beta, widened for its two roundings."""
        d = uc.shape[-1]
        norm0 = np.sqrt(np.square(uc).sum(axis=-1, keepdims=True))
        rho = np.sqrt(np.square(ru).sum(axis=-1, keepdims=True)) * (1 + REL)
        s_lo, s_hi = self.variance_range(norm0, rho, d, self.eps)
        zr = self.jacobian_ranges(uc - ru, uc + ru, s_lo, s_hi)[3]
        gg = np.broadcast_to(g, (d,))
        bb = np.zeros(d) if b is None else np.broadcast_to(b, (d,))
        y1, y2 = gg * zr[0] + bb, gg * zr[1] + bb
        lo, hi = np.minimum(y1, y2), np.maximum(y1, y2)
        pad = REL * (np.abs(lo) + np.abs(hi)) + 1e-300
        return lo - pad, hi + pad

    # derived graphs (n = u r and r = (mean u^2 + eps)^-1/2 given as nodes, the last axis)
    def tangent_graph(self, b: GraphBuilder, t: str, n: str, r: str) -> dict[str, str]:
        """dn = r (du - n mean(n du)), du = t - mean t: the nodes du, w = mean(n du), dn."""
        axes = b.ints([-1])
        keep = {"keepdims": 1}
        du = b.op("Sub", [t, b.op("ReduceMean", [t, axes], keep)])
        w = b.op("ReduceMean", [b.op("Mul", [n, du]), axes], keep)
        dn = b.op("Mul", [r, b.op("Sub", [du, b.op("Mul", [n, w])])], hint="ln_dn")
        return {"du": du, "w": w, "dn": dn}

    def adjoint_graph(self, b: GraphBuilder, gy: str, n: str, r: str,
                      scale: str | None) -> str:
        """J^T g = r (g - mean g - n mean(n g)), g = gy scale (J = r (I - n n^T / D)
        (I - 1 1^T / D) symmetric in its two factors' product with g; mean n = 0)."""
        g = b.op("Mul", [gy, scale]) if scale else gy
        axes = b.ints([-1])
        keep = {"keepdims": 1}
        centred = b.op("Sub", [g, b.op("ReduceMean", [g, axes], keep)])
        along = b.op("Mul", [n, b.op("ReduceMean", [b.op("Mul", [n, g]), axes], keep)])
        return b.op("Mul", [r, b.op("Sub", [centred, along])])

    @staticmethod
    def normalised_limit(d: int) -> float:
        """|n_i| for a zero-sum vector n of norm <= sqrt(D): at most sqrt(D - 1), rounded up."""
        return math.sqrt(d - 1) * (1 + REL)

    # ball arithmetic
    def arb(self, arb: Any) -> Callable[..., Any]:
        """(x, scale, bias) -> y on object arrays of balls: (x - mean) (mean of its squares
        + eps)^-1/2 scale + bias over the axes from `axis` on."""
        eps = arb(self.eps)

        def f(x: Any, scale: Any, bias: Any = None) -> Any:
            ax = self.axis % x.ndim
            axes = tuple(range(ax, x.ndim))
            n = arb(int(np.prod(x.shape[ax:])))
            u = x - np.sum(x, axis=axes, keepdims=True) / n
            var = np.sum(u * u, axis=axes, keepdims=True) / n
            r = np.frompyfunc(lambda v: (v + eps).rsqrt(), 1, 1)(var)
            y = u * r * scale
            if bias is not None:
                y = y + bias
            return np.asarray(y, dtype=object)
        return f


__all__ = ["REL", "LayerNormalization", "decimal_attr"]
