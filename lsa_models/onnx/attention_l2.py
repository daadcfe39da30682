"""L2 attention (Theorem 3.2) read from a graph: the checks after its logits are recognised
(coefficient sign, masks, tied weights, no query bias) and its value path, `X M_h` with the
columns of `M_h` in the span of `W^Q_h` (docs/bounds.md, "L2 attention read from a graph")."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor

from .attention_probe import AttentionLayer, NotAttention, Probe, per_head

# 2^-20 relative: a product A W^V folded into a float32 constant by the exporter is read as
# the exact product the module computes (docs/bounds.md, Conventions)
_A_RTOL = 2.0 ** -20


def finish_l2(probe: Probe, envs: Sequence[Mapping[str, Tensor]], xs: list[np.ndarray],
              v_name: str,
              layer: AttentionLayer,
              fit: tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray],
              heads_o: int) -> None:
    """L2 logits `-c ||q_i - k_j||^2 + r_i + m_ij` were found (fit = per-head c, the
    residual r + m, the sampled logits, their finite entries): what Theorem 3.2 needs, or
    the reason it does not apply (in `layer.reason`)."""
    c, resid, ls, finite = fit
    if float(c.min()) <= 0:
        raise NotAttention("its logits grow with the distance (a positive L2 coefficient)")
    where = f"attention at Softmax {layer.softmax}"
    assert layer.bq is not None
    tol = 1e-7 * (1 + max(float(np.abs(lg[finite]).max()) for lg in ls))
    masked = np.abs(resid).max() > tol
    if masked and finite.all() and _additive_causal(resid, tol):
        layer.causal, masked = True, False
        if _ADDITIVE_CAUSAL_NOTE not in layer.notes:
            layer.notes.append(_ADDITIVE_CAUSAL_NOTE)
    if masked:
        layer.reason = (f"{where}: L2 logits with an additive mask other than causal masking "
                        "are not covered by Theorem 3.2")
    elif not finite.all() and not layer.causal:
        layer.reason = (f"{where}: L2 attention with a mask other than causal is not covered "
                        "by Theorem 3.2")
    elif not layer.tied:
        layer.reason = (f"{where}: L2 attention with untied query/key weights is not covered "
                        "by Theorem 3.2 (not Lipschitz in general); tie them (keys = queries) "
                        "to get a certificate")
    elif np.abs(layer.bq).max() > 0:
        layer.reason = (f"{where}: L2 attention with a query bias is not covered by "
                        "Theorem 3.2; drop the bias of the query projection")
    else:
        _l2_values(probe, envs, xs, v_name, layer, ls[0].shape[0], heads_o)


# exp(t) rounds to 0 in float64 (and float32) for t < -745.14: a key masked by at least this
# much below the diagonal's logit gets weight exactly 0 (docs/bounds.md, Conventions)
_UNDERFLOW = -746.0
_ADDITIVE_CAUSAL_NOTE = ("an additive mask at most -746 above the diagonal is read as causal "
                         "masking: exp underflows to exactly 0 there in float32 and float64")


def _additive_causal(resid: np.ndarray, tol: float) -> bool:
    """Whether the logits' constant residual (G, N, N), row constants removed, is a causal
    mask written additively (neural_stpp's `triu(full(-1e9), 1)`, in any layout the softmax
    axis implies): zero on and below the diagonal, at most `_UNDERFLOW` above it. Tied L2
    logits peak on the diagonal (`-c ||q_i - q_i||^2 = 0`), so a masked key's weight relative
    to the diagonal's is at most `exp(m_ij)`, which the softmax rounds to exactly 0."""
    n = resid.shape[-1]
    lower = np.tril(np.ones((n, n), dtype=bool))
    if n < 2 or not np.abs(resid[..., lower]).max() <= tol:
        return False
    return bool(resid[..., ~lower].max() <= _UNDERFLOW)


def _l2_values(probe: Probe, envs: Sequence[Mapping[str, Tensor]], xs: list[np.ndarray],
               v_name: str, layer: AttentionLayer, g: int, heads_o: int) -> None:
    """Theorem 3.2's value path read by what it computes (docs/bounds.md, "L2 attention read
    from a graph: the value path").

    Per head, what the weights multiply is `X M_h + b_h` for a constant `M_h` (D, w), probed
    as the projections are; the tail after `P @ V` holds whatever the graph applies after the
    weights (`probe_tail`). Head h is Theorem 3.2's map exactly when `M_h = A_h W'_h` with
    `A_h = W^Q_h W^Q_h^T / sqrt(d)`, i.e. when the columns of `M_h` lie in the span of
    `W^Q_h`; then `W'_h = A_h^+ M_h` (through the SVD of `W^Q_h`) is the value matrix the
    bound uses. Any association order gives the same `M_h`: `(X A_h) W^V_h`, one folded
    constant `A_h W^V_h`, or the queries `X W^Q_h` weighted first and `W^Q_h^T W^V_h` applied
    after P (then `M_h = W^Q_h`, and the tail holds the rest). A value bias adds `1 b_h^T`
    after P (its rows sum to 1): a constant."""
    reason = (f"attention at Softmax {layer.softmax}: L2 logits recognised, but what the "
              "attention weights multiply is not in the span of the query projection, "
              "X W^Q_h C_h (Theorem 3.2 needs the values X W^Q W^Q^T W^V, in any association "
              "order; independent values X W^V are not covered)")
    assert layer.wq is not None
    if heads_o != g:
        layer.reason = reason
        return
    try:
        ((m_all, _),) = probe.affine([(v_name, False)], envs, xs)  # (G, D, w), (G, w)
        m_all = per_head(m_all, g)
    except NotAttention:
        layer.reason = reason
        return
    d = layer.wq.shape[-1]
    wv, worst = [], 0.0
    for h in range(g):
        m = m_all[h]
        u, s, _ = np.linalg.svd(layer.wq[h], full_matrices=False)  # W^Q_h = U S V^T
        # the rank as numpy's matrix_rank reads it: directions below it are rounding noise
        keep = s > s.max(initial=0.0) * max(layer.wq.shape[1:]) * np.finfo(float).eps
        u, s = u[:, keep], s[keep]
        um = u.T @ m  # (r, w)
        outside = float(np.abs(m - u @ um).max())
        scale = float(np.abs(m).max())
        if not outside <= _A_RTOL * scale:
            layer.reason = reason
            return
        worst = max(worst, outside / scale if scale > 0 else 0.0)
        # A_h^+ = sqrt(d) U S^-2 U^T: A_h W'_h = U U^T M_h = M_h
        wv.append(math.sqrt(d) * (u / (s * s)) @ um)
    if worst > 1e-12:
        # beyond float64 rounding (~1e-16): a product folded in float32 (~1e-8)
        note = ("the folded value-path constant (A W^V, float32) is read as the exact "
                "product with A = W^Q W^Q^T / sqrt(d) (matched to 2^-20 relative)")
        if note not in layer.notes:
            layer.notes.append(note)
    layer.wv = np.stack(wv)  # (H, D, w)
