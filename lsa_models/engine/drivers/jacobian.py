"""The local driver: the Jacobian of an ONNX graph enclosed over a ball around one input.

Runs the graph once in float64 at the centre X0 (every tensor's centre value), then walks the
input-dependent nodes in graph order, applying each op's local rule (enclosure/rules.py) to carry a
`LocalValue` per tensor. At the output, the Jacobian over the ball lies in `jc +- jr`, so
  ||J||_2   <= ||jc||_2 + ||jr||_2             (|E| <= jr entrywise => ||E||_2 <= ||jr||_2)
  ||J||_inf <= max_i sum_j (|jc_ij| + jr_ij)
both computed with upward rounding (docs/local-enclosure.md).

The walk is drivers/jacobian_walk.py, the telescoped remainder remainders/telescope.py, the centre's
checks and forward pass drivers/centre.py; the margins from the affine forms alone (no enclosure)
drivers/margins.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from lsa_models.bounds.numerics import (
    U,
    add_up,
    frobenius_upper,
    inf_norm_upper,
    spectral_norm_upper,
)
from lsa_models.engine.drivers.centre import Centre, check_center, check_eps
from lsa_models.engine.drivers.jacobian_walk import MAX_JACOBIAN_ENTRIES, walk
from lsa_models.engine.enclosure.rules import exact
from lsa_models.engine.remainders.structured_norms import Structured
from lsa_models.engine.remainders.telescope import Telescope
from lsa_models.engine.values import Ball, LocalNotCertified, LocalValue, Values, widen_up
from lsa_models.onnx.loading import OnnxModel

# Balls of radius eps/2, eps/4, ... walked before the ball itself (values by the integrated
# mean value form); each costs one more walk. One halving tightens a Transformer's inf-ball
# bound by a few percent; more add almost nothing (bench/local_tightness.py).
HALVINGS = 1


@dataclass
class LocalJacobian:
    """The enclosure of the graph output's Jacobian over the ball, rows = output entries."""

    ball: Ball
    output: np.ndarray  # F(X0), flattened (K,)
    jc: np.ndarray  # (K, P)
    jr: np.ndarray  # (K, P)
    out_lo: np.ndarray  # enclosure of F over the ball (K,)
    out_hi: np.ndarray
    # (node, kind, local factor, rule) per reported layer
    layers: list[tuple[str, str, float, str]] = field(default_factory=list)
    # j -> a bound on |grad (f_label - f_j)(X) - (jc_label - jc_j)| over the ball (P,), from
    # the margin's own telescoped remainder (local_jacobian(margins_of=label))
    margin_jr: dict[int, np.ndarray] = field(default_factory=dict)

    # bounds on the norms of J(X) - jc from the factored terms (remainders/structured_norms.py);
    # None: not run
    structured: Structured | None = None
    # j -> bound on ||grad (f_label - f_j)(X)||_dual over the ball from the factored terms
    margin_dual: dict[int, float] = field(default_factory=dict)
    # whether the float64 centre values' error was proven (rounding/forward_error.py), and the
    # margin
    forward_checked: bool = False
    forward_detail: str = ""
    # bound on sup ||J(X) - jc||_2 from the operator-norm terms (remainders/operator_norms.py;
    # 2-ball only)
    opnorm_two: float | None = None

    def upper(self) -> float:
        """Certified bound on sup ||J_F(X)||_p over the ball: the entrywise enclosure's norm,
        or the structured one when smaller."""
        st = self.structured
        if self.ball.norm == "2":
            plain = add_up(spectral_norm_upper(self.jc), spectral_norm_upper(self.jr))
            if st is not None:
                plain = min(plain, add_up(spectral_norm_upper(self.jc), st.mat_two))
            if self.opnorm_two is not None:
                plain = min(plain, add_up(spectral_norm_upper(self.jc), self.opnorm_two))
            return plain
        plain = inf_norm_upper(np.abs(self.jc) + self.jr) * (1.0 + 2.0**-50)
        if st is not None:
            rows = widen_up(np.abs(self.jc).sum(axis=1), self.jc.shape[1]) + st.rows_inf
            plain = min(plain, float(rows.max()) * (1.0 + 2.0**-50))
            if st.rows_abs is not None:  # the signed rows (remainders/signed_adjoints.py)
                plain = min(plain, float(st.rows_abs.max()) * (1.0 + 2.0**-50))
        return plain

    def center_norm(self) -> float:
        """||J_F(X0)|| (float64, not rounded: a reference, not a bound)."""
        o = 2 if self.ball.norm == "2" else np.inf
        return float(np.linalg.norm(self.jc, ord=o))


def local_jacobian(model: OnnxModel, x0: np.ndarray, eps: float, norm: str,
                   telescope: bool = True, margins_of: int | None = None,
                   halvings: int | None = None, whole: bool = True,
                   quad: bool = False) -> LocalJacobian:
    """Enclose the output's Jacobian over `{X : ||X - X0||_norm <= eps}`. Raises
    LocalNotCertified when an op has no local rule or a range leaves an op's domain.

    With `telescope`, the inputs of the range-sensitive ops (CHECKPOINTS) and the output get
    the telescoped remainder (exact adjoints at X0) instead of the forward one, whichever is
    smaller entrywise. With `margins_of` = a label Y, the margins f_Y - f_j also get their own
    telescoped remainder (`LocalJacobian.margin_jr`). `halvings`: the balls of radius
    eps 2^-L walked first (default HALVINGS); `whole=False` skips the whole output's
    factored and operator-norm bounds (`structured`, `opnorm_two`: None), for callers that
    read only the rows and the margins (the robustness sweep). `quad`: the value forms in
    lockstep carry second-order symbols (affine.QUAD)."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    check_eps(eps)
    x = check_center(model, x0)
    if x.size * x.size > MAX_JACOBIAN_ENTRIES:
        raise LocalNotCertified(f"the input has {x.size} entries: its Jacobian enclosure would "
                                f"exceed {MAX_JACOBIAN_ENTRIES} entries per tensor")
    # the forward margin, proven a posteriori (rounding/forward_error.py), set for the walks
    with Centre(model, x) as ctr:
        return _enclose_all(model, ctr.module, ctr.env, x, float(eps), norm, telescope,
                            margins_of, ctr.proven is not None, ctr.detail,
                            HALVINGS if halvings is None else halvings, whole, quad)


def _enclose_all(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor],
                 x: np.ndarray, eps: float, norm: str, telescope: bool,
                 margins_of: int | None, checked: bool, detail: str, halvings: int = 1,
                 whole: bool = True, quad: bool = False) -> LocalJacobian:
    ball = Ball(x, float(eps), norm)
    tight: Telescope | None = None
    if telescope and eps > 0:
        zero, _ = walk(model, module, env, Ball(x, 0.0, norm), None)
        tight = Telescope(model, x, zero)
        # the signed terms (remainders/signed_adjoints.py) pay off on the inf-ball; on the 2-ball
        # the operator-norm terms (remainders/operator_norms.py) do the same job at a fraction of
        # the cost
        tight.signed_terms = norm == "inf"
    half: Values | None = None
    if tight is not None:
        # the balls of radius eps 2^-L, ..., eps/2 first: each one's remainders bound the next
        # one's values by the integrated form (`integrated`)
        for level in range(halvings, 0, -1):
            try:
                half, _ = walk(model, module, env, Ball(x, float(eps) * 0.5**level, norm),
                                tight, half, quad)
            except LocalNotCertified:
                half = None
    values, layers = walk(model, module, env, ball, tight, half, quad)
    out = values[model.spec.output_name]
    if not isinstance(out, LocalValue):
        out = exact(np.asarray(out, dtype=np.float64), ball)
    k = out.center.size
    margin_jr: dict[int, np.ndarray] = {}
    margin_dual: dict[int, float] = {}
    st: Structured | None = None
    opnorm_two: float | None = None
    if tight is not None:
        out = tight.tighten(model.spec.output_name, out, values, ball)
        if margins_of is not None:
            margin_jr, margin_dual = _margin_bounds(tight, model.spec.output_name, values,
                                                    out, ball, margins_of)
        if whole:
            st = tight.structured(model.spec.output_name, values, ball)
            opnorm_two = tight.whole_opnorm(model.spec.output_name, values, ball)
    if not (np.all(np.isfinite(out.jc)) and np.all(np.isfinite(out.jr))):
        raise LocalNotCertified("the Jacobian enclosure overflowed on this ball (too wide "
                                "for the op-by-op ranges)")
    return LocalJacobian(ball, out.center.reshape(k), out.jc.reshape(k, -1),
                         out.jr.reshape(k, -1), out.lo.reshape(k), out.hi.reshape(k), layers,
                         margin_jr, st, margin_dual, checked, detail, opnorm_two)


def _margin_bounds(tight: Telescope, name: str, values: Values, out: LocalValue, ball: Ball,
                   label: int) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    """The margins f_label - f_j telescoped as rows of their own: per j, the entrywise
    remainder (P,) and the factored bound on ||grad m_j(X)||_dual (both where they exist)."""
    k = out.center.size
    margin_jr: dict[int, np.ndarray] = {}
    margin_dual: dict[int, float] = {}
    others = [j for j in range(k) if j != label]
    combos = np.zeros((len(others), k))
    combos[:, label] = 1.0
    combos[np.arange(len(others)), others] = -1.0
    rem = tight.remainder(name, values, ball, combos)
    if rem is not None:
        margin_jr = dict(zip(others, rem, strict=True))
    mst = tight.structured(name, values, ball, combos)
    if mst is not None:
        jcm = combos @ out.jc.reshape(k, -1)  # (M, P) centre gradients of the margins
        for r, j in enumerate(others):
            if ball.norm == "inf":
                base = float(widen_up(np.abs(jcm[r]).sum(), jcm.shape[1] + 2))
                margin_dual[j] = add_up(base, float(mst.rows_inf[r]))
                if mst.rows_abs is not None:
                    margin_dual[j] = min(margin_dual[j], float(mst.rows_abs[r]))
            else:
                base = frobenius_upper(jcm[r]) * (1 + 4 * U)
                margin_dual[j] = add_up(base, float(mst.rows_two[r]))
    if ball.norm == "2":
        _opnorm_margins(tight, name, values, combos, others, out.jc.reshape(k, -1), margin_dual)
    return margin_jr, margin_dual


def _opnorm_margins(tight: Telescope, name: str, values: Values, combos: np.ndarray,
                    others: list[int], jc: np.ndarray, margin_dual: dict[int, float]) -> None:
    """2-ball: ||grad m_j(X)||_2 <= ||grad m_j(X0)||_2 + its operator-norm remainder, kept
    where smaller than the other margin bounds."""
    mop = tight.opnorm(name, values, combos)
    if mop is None:
        return
    jcm = combos @ jc  # (M, P) centre gradients of the margins
    for r, j in enumerate(others):
        cand = add_up(frobenius_upper(jcm[r]) * (1 + 4 * U), float(mop[r]))
        margin_dual[j] = min(margin_dual.get(j, math.inf), cand)

