"""L2 attention (Theorem 3.2) read from a graph: the checks after its logits are recognised
(coefficient sign, masks, tied weights, no query bias) and its value path `X A_h W^V_h` with
`A_h = c' W^Q_h W^Q_h^T` (docs/bounds.md, "L2 attention read from a graph")."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor

from .attention_probe import (
    FIT_MARGIN,
    TOL,
    AttentionLayer,
    NotAttention,
    Probe,
    per_head,
    token_view,
)
from .graph import GraphInfo
from .ops import Node

# 2^-20 relative: A = c' W^Q W^Q^T folded into a float32 constant by the exporter (dynamo
# does) is read as the exact product the module computes (docs/bounds.md, Conventions)
_A_RTOL = 2.0 ** -20


def finish_l2(info: GraphInfo, nodes: list[Node], probe: Probe,
              envs: Sequence[Mapping[str, Tensor]], xs: list[np.ndarray], v_name: str,
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
    if np.abs(resid).max() > 1e-7 * (1 + max(float(np.abs(lg[finite]).max()) for lg in ls)):
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
        _l2_values(info, nodes, probe, envs, xs, v_name, layer, ls[0].shape[0], heads_o)


def _l2_values(info: GraphInfo, nodes: list[Node], probe: Probe,
               envs: Sequence[Mapping[str, Tensor]], xs: list[np.ndarray], v_name: str,
               layer: AttentionLayer, g: int, heads_o: int) -> None:
    """The value path must be `X A_h W^V_h` with `A_h = c' W^Q_h W^Q_h^T`: find the constant
    MatMul producing the values, probe its input Z (= X A_h) and check A_h."""
    reason = (f"attention at Softmax {layer.softmax}: L2 logits recognised, but the values do "
              "not pass through the query projection as X W^Q W^Q^T W^V (Theorem 3.2 needs "
              "that value path; independent values X W^V are not covered)")
    t = v_name
    by_name = {nd.name: nd for nd in nodes}
    mm = None
    while t in info.producer and info.producer[t].name in by_name:
        nd = info.producer[t]
        if nd.op_type == "MatMul" and nd.inputs[1] not in info.var:
            mm = nd
            break
        if nd.op_type not in ("Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze"):
            break
        t = nd.inputs[0]
    assert layer.wq is not None
    if heads_o != g:
        layer.reason = reason
        return
    if mm is not None:
        z_name = mm.inputs[0]
        wv_const = info.env[mm.inputs[1]].detach().numpy()
    else:
        # the values are Z = X A_h themselves, W^V applied after P (neural_stpp writes
        # `(P (X A_h)) W^V_h`, the same map): W^V_h = I here, and the tail's W^O holds
        # blockdiag(W^V_h) W^O (docs/bounds.md, "Sequence-first logits")
        z_name = v_name
        width = probe.width
        wv_const = np.eye(width)
    try:
        ((wz, bz),) = probe.affine([(z_name, False)], envs, xs)
    except NotAttention:
        layer.reason = reason
        return
    if wz.shape[0] != g or wz.shape[1] != wz.shape[2] or np.abs(bz).max() > 0:
        layer.reason = reason
        return
    wv = wv_const.reshape(-1, *wv_const.shape[-2:])
    wv = per_head(wv, g)
    factors = []
    for h in range(g):
        m = layer.wq[h] @ layer.wq[h].T  # (D, D)
        cp = float((wz[h] * m).sum() / max((m * m).sum(), 1e-300))
        # 2^-20 relative: A = c' W^Q W^Q^T folded into a float32 constant by the exporter
        # (dynamo does) is read as the exact product the module computes (docs/bounds.md)
        if cp <= 0 or not np.abs(wz[h] - cp * m).max() <= _A_RTOL * np.abs(wz[h]).max():
            layer.reason = reason
            return
        # beyond float64 rounding (~1e-16): a constant folded in float32 (~1e-8)
        if not np.abs(wz[h] - cp * m).max() <= 1e-12 * np.abs(wz[h]).max():
            note = ("the folded value-path constant A = c' W^Q W^Q^T (float32) is read as "
                    "the exact product (matched to 2^-20 relative)")
            if note not in layer.notes:
                layer.notes.append(note)
        factors.append(cp * math.sqrt(layer.wq.shape[-1]))
    # the values must then be Z_h W^V_h per head: check on the samples
    for env in envs:
        zv = token_view(env[z_name], probe.n, False)
        vv = token_view(env[v_name], probe.n, False)
        if zv.shape[0] != g or vv.shape[0] != g or not np.allclose(
                zv @ wv, vv, rtol=0,
                atol=TOL * (1 + np.abs(vv).max())):
            layer.reason = reason
            return
    layer.wv = wv
    # f = P X (c' W W^T) W^V = theorem's map with W^V scaled by c' sqrt(d) (docs/bounds.md)
    layer.value_factor = math.nextafter(max(factors) * (1 + FIT_MARGIN), math.inf)
