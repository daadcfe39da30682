"""The local driver: the Jacobian of an ONNX graph enclosed over a ball around one input.

Runs the graph once in float64 at the centre X0 (every tensor's centre value), then walks the
input-dependent nodes in graph order, applying each op's local rule (rules.py) to carry a
`LocalValue` per tensor. At the output, the Jacobian over the ball lies in `jc +- jr`, so
  ||J||_2   <= ||jc||_2 + ||jr||_2             (|E| <= jr entrywise => ||E||_2 <= ||jr||_2)
  ||J||_inf <= max_i sum_j (|jc_ij| + jr_ij)
both computed with upward rounding (docs/local-enclosure.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..bounds.numerics import (
    U,
    add_up,
    frobenius_upper,
    inf_norm_upper,
    mul_up,
    spectral_norm_upper,
    sqrt_up,
)
from ..onnx.loading import OnnxModel
from ..onnx.ops import Node, decimal_attr
from ..operators import ACTIVATION_TYPES, ModeNotImplemented, activation
from . import affine, affine_rules, deferred, forward_error, fused, relu_head, second, signed
from .opnorm import integrated_tokens, rows_bound, set_token_radius
from .primitives import LIBM_REL, elementwise
from .rules import LOCAL_RULES, LocalRule, exact
from .structured import Structured, row_two_bounds, structured_bounds
from .values import (
    FORWARD_MARGIN,
    MARGIN,
    PROVEN,
    Ball,
    LocalNotCertified,
    LocalValue,
    array_key,
    center_margin,
    dual_row_norms,
    enclose,
    input_value,
    widen_up,
)

# Jacobian entries the engine will hold for one tensor (float64): beyond it, the ball is
# bounded by per-layer rules instead.
MAX_JACOBIAN_ENTRIES = 40_000_000


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

    # bounds on the norms of J(X) - jc from the factored terms (structured.py); None: not run
    structured: Structured | None = None
    # j -> bound on ||grad (f_label - f_j)(X)||_dual over the ball from the factored terms
    margin_dual: dict[int, float] = field(default_factory=dict)
    # whether the float64 centre values' error was proven (forward_error.py), and the margin
    forward_checked: bool = False
    forward_detail: str = ""
    # bound on sup ||J(X) - jc||_2 from the operator-norm terms (opnorm.py; 2-ball only)
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
            if st.rows_abs is not None:  # the signed rows (signed.py)
                plain = min(plain, float(st.rows_abs.max()) * (1.0 + 2.0**-50))
        return plain

    def center_norm(self) -> float:
        """||J_F(X0)|| (float64, not rounded: a reference, not a bound)."""
        o = 2 if self.ball.norm == "2" else np.inf
        return float(np.linalg.norm(self.jc, ord=o))


def graph_input_shape(model: OnnxModel) -> tuple[int, ...]:
    spec = model.spec
    n = spec.seq_len
    if n is None:
        raise ValueError("the graph has a dynamic sequence length: local bounds need a "
                         "fixed one")
    if spec.rank == 2:
        return (n, spec.d_model)
    if spec.batch not in (None, 1):
        raise ValueError(f"the graph has a fixed batch size {spec.batch}; local bounds "
                         "need batch 1")
    return (1, n, spec.d_model)


def check_center(model: OnnxModel, x0: np.ndarray) -> np.ndarray:
    """X0 as the graph input (1, N, D) (or (N, D)); a leading batch dim of 1 allowed."""
    shape = graph_input_shape(model)
    x = np.asarray(x0)
    if not np.issubdtype(x.dtype, np.floating) and not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"the input must hold numbers, got dtype {x.dtype}")
    x = x.astype(np.float64)
    n, d = shape[-2], shape[-1]
    if x.shape not in ((n, d), (1, n, d)):
        raise ValueError(f"the input has shape {tuple(x.shape)}; the model takes one input "
                         f"of shape ({n}, {d}) (a leading batch dimension of 1 allowed)")
    if not np.all(np.isfinite(x)):
        raise ValueError("the input has non-finite entries")
    return x.reshape(shape)


def center_sha256(x0: np.ndarray) -> str:
    """Hash of the centre as float64 little-endian bytes in C order."""
    return hashlib.sha256(np.ascontiguousarray(x0, dtype="<f8").tobytes()).hexdigest()


def _check_eps(eps: float) -> None:
    if not (eps >= 0 and np.isfinite(eps)):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


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
    _check_eps(eps)
    x = check_center(model, x0)
    if x.size * x.size > MAX_JACOBIAN_ENTRIES:
        raise LocalNotCertified(f"the input has {x.size} entries: its Jacobian enclosure would "
                                f"exceed {MAX_JACOBIAN_ENTRIES} entries per tensor")
    module = model.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x))
    # the forward margin, proven a posteriori (forward_error.py)
    errors: dict[str, np.ndarray] = {}
    proven, detail = forward_error.check(list(module.runtime_nodes),  # type: ignore[arg-type]
                                         model.spec.input_name, x, env, errors)
    token = MARGIN.set(FORWARD_MARGIN if proven is None else proven)
    # the graph tensors' own proven errors (entrywise: no per-tensor floor)
    known: dict = {} if proven is None else {array_key(env[n].detach().numpy()): (None, e)
                                             for n, e in errors.items() if n in env}
    token_p = PROVEN.set(known)
    try:
        return _enclose_all(model, module, env, x, float(eps), norm, telescope, margins_of,
                            proven is not None, detail,
                            HALVINGS if halvings is None else halvings, whole, quad)
    finally:
        PROVEN.reset(token_p)
        MARGIN.reset(token)


class Centre:
    """The float64 forward pass at X0 with its proven forward margin set (MARGIN, PROVEN) for
    the duration of a `with` block."""

    def __init__(self, model: OnnxModel, x: np.ndarray) -> None:
        self.module = model.module.with_dtype(torch.float64)
        with torch.no_grad():
            self.env = self.module.run_env(torch.from_numpy(x))
        errors: dict[str, np.ndarray] = {}
        self.proven, self.detail = forward_error.check(
            list(self.module.runtime_nodes), model.spec.input_name, x,  # type: ignore[arg-type]
            self.env, errors)
        self.known: dict = {} if self.proven is None else {
            array_key(self.env[n].detach().numpy()): (None, e)
            for n, e in errors.items() if n in self.env}

    def __enter__(self) -> Centre:
        self._tokens = (MARGIN.set(FORWARD_MARGIN if self.proven is None else self.proven),
                        PROVEN.set(self.known))
        return self

    def __exit__(self, *exc: object) -> None:
        PROVEN.reset(self._tokens[1])
        MARGIN.reset(self._tokens[0])


# the affine route's products record their cross terms' l1 budgets (affine.GROUPS: a
# perturbation cannot put every entry's cross term at its extreme at once; larger radii)
SYMBOL_GROUPS = True


def margin_lower_bounds(model: OnnxModel, x0: np.ndarray, eps: float, norm: str, label: int,
                        centre: Centre | None = None, quad: bool = False, eig: bool = False
                        ) -> dict[int, float] | None:
    """Lower bounds of the margins f_label - f_j over the ball, from the affine forms alone
    (affine.py: no Jacobian enclosure); None when the forms do not reach the output. `eig`:
    with `quad` on the 2-ball, the second-order parts of the entries' sizes by their
    quadratic forms' eigenvalues (affine.QUAD_EIG: tighter, ~4x the time)."""
    _check_eps(eps)
    x = check_center(model, x0)
    ctr = centre if centre is not None else Centre(model, x)
    # the products' cross terms as l1 groups of symbols (affine.GROUPS) for this walk and its
    # margins
    token_g = affine.GROUPS.set([] if SYMBOL_GROUPS else None)
    token_e = affine.QUAD_EIG.set(eig and quad)
    try:
        return _margin_lower_bounds(model, x, eps, norm, label, ctr, quad)
    finally:
        affine.QUAD_EIG.reset(token_e)
        affine.GROUPS.reset(token_g)


def _margin_lower_bounds(model: OnnxModel, x: np.ndarray, eps: float, norm: str, label: int,
                         ctr: Centre, quad: bool) -> dict[int, float] | None:
    with ctr:
        ball = Ball(x, float(eps), norm)
        chains, inside = _chains(model, ctr.module, ctr.env)
        nodes: list[Node] = list(ctr.module.runtime_nodes)  # type: ignore[arg-type]
        tail = deferred.find_tail(nodes, model.spec.output_name, ctr.env, rms=True,
                                  input_name=model.spec.input_name) if DEFER else None
        capture: dict[str, affine.Aff | None] = {} if tail is None else {
            tail[0].inputs[0]: None}
        relu = None
        if tail is None and DEFER:
            # a ReLU head instead: its input's and output's forms (relu_head.py)
            relu = relu_head.find_relu_tail(nodes, model.spec.output_name, ctr.env,
                                            model.spec.input_name)
            if relu is not None:
                capture = {relu[0].inputs[0]: None, relu[0].outputs[0]: None}
                capture.update({name: None for name, _ in relu[2]})
        space: list[int] = []
        forms = affine_rules.walk(nodes, model.spec.input_name, ctr.env, ball, chains, inside,
                                  model.spec.output_name, everything=False, capture=capture,
                                  space=space, quad=quad)
        out = forms.get(model.spec.output_name)
        if out is None:
            return None
        # the margins' ranges and the deferred head's products read the walk's second-order
        # symbols, when it had them; the head's errors get symbols after the walk's
        token_q = affine.QUAD.set(ball.size if quad else None)
        token_s = affine.SPACE.set(list(space) if space else None)
        try:
            if relu is not None:
                return _relu_margins(ctr.env, ball, out, label, relu, capture)
            return _margins_of_forms(nodes, model.spec.output_name, ctr.env, ball, out,
                                     label, tail, capture)
        finally:
            affine.SPACE.reset(token_s)
            affine.QUAD.reset(token_q)


def _relu_margins(env: dict[str, torch.Tensor], ball: Ball, out: affine.Aff, label: int,
                  relu: relu_head.Tail, capture: dict[str, affine.Aff | None]
                  ) -> dict[int, float]:
    """The plain margins and those with the head's ReLU relaxed per margin (relu_head.py):
    both lower bounds of the same margins, the larger stands."""
    res = affine.margins(out, label, ball)
    z, y = capture.get(relu[0].inputs[0]), capture.get(relu[0].outputs[0])
    sides = [(name, pos, capture.get(name)) for name, pos in relu[2]]
    if z is None or y is None or any(f is None for _, _, f in sides):
        return res
    try:
        low = relu_head.margins(relu[1], env, ball, relu[0], z, y, out, label,
                                sides)  # type: ignore[arg-type]
    except (affine.NotAffine, FloatingPointError, ValueError, RuntimeError, KeyError,
            IndexError, TypeError):
        return res  # an optional refinement: the plain margins stand
    return {j: max(v, low.get(j, v)) for j, v in res.items()}


def _margins_of_forms(nodes: list[Node], output: str, env: dict[str, torch.Tensor],
                      ball: Ball, out: affine.Aff, label: int,
                      tail: tuple[Node, list[Node]] | None,
                      capture: dict[str, affine.Aff | None]) -> dict[int, float]:
    """The margins' lower bounds from the output's form, and from the final LayerNorm's
    product deferred past the head (deferred.py) where its input's form was captured: both
    are lower bounds of the same margins, the larger stands."""
    res = affine.margins(out, label, ball)
    if tail is None or not all(v is not None for v in capture.values()):
        return res
    try:
        low = deferred.margins(nodes, output, env, ball,
                               {k: v for k, v in capture.items() if v is not None},
                               out, label, tail)
    except (affine.NotAffine, FloatingPointError, ValueError, RuntimeError, KeyError,
            IndexError, TypeError):
        return res  # an optional refinement: the plain margins stand
    return res if low is None else {j: max(v, low[j]) for j, v in res.items()}


def _enclose_all(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor],
                 x: np.ndarray, eps: float, norm: str, telescope: bool,
                 margins_of: int | None, checked: bool, detail: str, halvings: int = 1,
                 whole: bool = True, quad: bool = False) -> LocalJacobian:
    ball = Ball(x, float(eps), norm)
    tight: _Telescope | None = None
    if telescope and eps > 0:
        zero, _ = _walk(model, module, env, Ball(x, 0.0, norm), None)
        tight = _Telescope(model, x, zero)
        # the signed terms (signed.py) pay off on the inf-ball; on the 2-ball the operator-norm
        # terms (opnorm.py) do the same job at a fraction of the cost
        tight.signed_terms = norm == "inf"
    half: Values | None = None
    if tight is not None:
        # the balls of radius eps 2^-L, ..., eps/2 first: each one's remainders bound the next
        # one's values by the integrated form (`integrated`)
        for level in range(halvings, 0, -1):
            try:
                half, _ = _walk(model, module, env, Ball(x, float(eps) * 0.5**level, norm),
                                tight, half, quad)
            except LocalNotCertified:
                half = None
    values, layers = _walk(model, module, env, ball, tight, half, quad)
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


def _margin_bounds(tight: _Telescope, name: str, values: Values, out: LocalValue, ball: Ball,
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


def _opnorm_margins(tight: _Telescope, name: str, values: Values, combos: np.ndarray,
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


# entries of _Telescope.plain_memo before it starts afresh (a walk asks for ~100 terms)
PLAIN_MEMO = 512
# Balls of radius eps/2, eps/4, ... walked before the ball itself (values by the integrated
# mean value form); each costs one more walk. One halving tightens a Transformer's inf-ball
# bound by a few percent; more add almost nothing (bench/local_tightness.py).
HALVINGS = 1
# Ops whose enclosures depend most on their input's range: their inputs are tightened.
CHECKPOINTS = ("LayerNormalization", "Softmax", "Div", "Exp", "Sqrt", "Reciprocal", "Pow", "Mul",
               "MatMul") + ACTIVATION_TYPES
Values = dict[str, LocalValue | np.ndarray]


def integrated(v: LocalValue, h: LocalValue | np.ndarray | None, ball: Ball) -> LocalValue:
    """Values by the integrated mean value form (docs/local-enclosure.md): the segment from X0 to
    X spends its first half in the ball of radius eps/2, where the Jacobian is within
    h.jr (+ |h.jc - jc|) of jc, so
    |T_i(X) - T_i(X0) - jc_i d| <= (eps/2) (||h.jr_i||_q + ||jr_i||_q)."""
    if not isinstance(h, LocalValue) or h.shape != v.shape:
        return v
    jr_h = widen_up(h.jr + np.abs(h.jc - v.jc), 2)
    rows = widen_up(dual_row_norms(np.abs(v.jc), ball.norm) + 0.5 * (
        dual_row_norms(jr_h, ball.norm) + dual_row_norms(v.jr, ball.norm)), 4)
    rad = widen_up(ball.eps * rows, 2) + center_margin(v.center)
    lo = np.minimum(np.maximum(v.lo, v.center - rad), v.center)
    hi = np.maximum(np.minimum(v.hi, v.center + rad), v.center)
    out = LocalValue(v.center, lo, hi, v.jc, v.jr, v.term, v.parts, v.opnorm, v.jnorm,
                     v.tok_rad, v.tok_jn, v.tok_true, v.second, nonlin=v.nonlin, jfac=v.jfac)
    integrated_tokens(out, h, ball)
    return out


def _walk(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor], ball: Ball,
          tight: _Telescope | None, half: Values | None = None, quad: bool = False
          ) -> tuple[Values, list[tuple[str, str, float, str]]]:
    """One pass over the input-dependent nodes in graph order; with `half` (the values on the
    ball of half the radius), every range is also bounded by the integrated form; `quad`:
    the forms in lockstep with second-order symbols (affine.QUAD)."""
    values: Values = {model.spec.input_name: input_value(ball)}
    layers: list[tuple[str, str, float, str]] = []
    chains, inside = _chains(model, module, env)
    nodes: list[Node] = list(module.runtime_nodes)  # type: ignore[arg-type]
    forms = _Forms(ball, values, env, affine_rules.uses(nodes, chains, inside),
                   model.spec.output_name) if ball.eps > 0 and AFFINE else None
    if forms is not None:
        forms.forms[model.spec.input_name] = affine.input_form(ball)
    q = quad and forms is not None
    t = affine.quad_size(ball.size) if q else 0
    token = affine.SPACE.set([ball.size, t, t])  # the second-order symbols: reserved
    token_q = affine.QUAD.set(ball.size if q else None)
    try:
        _walk_nodes(model, module, env, ball, tight, half, values, layers, chains, inside, forms)
    finally:
        affine.QUAD.reset(token_q)
        affine.SPACE.reset(token)
    return values, layers


def _walk_nodes(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor],
                ball: Ball, tight: _Telescope | None, half: Values | None, values: Values,
                layers: list[tuple[str, str, float, str]], chains: dict[str, fused.Chain],
                inside: set[str], forms: _Forms | None) -> None:
    for node in module.runtime_nodes:  # type: ignore[union-attr]
        if node.name in inside:
            chain = chains.get(node.name)
            if chain is not None:  # inner links are bounded at their chain's sink
                layers.append(_walk_chain(node, chain, values, env, ball, tight))
                if forms is not None:
                    forms.step(node, [chain.root], [chain.sink], chain)
            continue
        if tight is not None:
            _checkpoint(node, values, ball, tight, half, forms)
        args = [None if not i else values[i] if i in values else
                (env[i].detach().numpy() if i in env else None) for i in node.inputs]
        centers = [None if not o or o not in env else env[o].detach().numpy()
                   for o in node.outputs]
        if not any(isinstance(a, LocalValue) for a in args) or \
                node.op_type in ("Shape", "Size"):
            for o, c in zip(node.outputs, centers, strict=False):
                if o and c is not None:
                    values[o] = c  # shape arithmetic and constants
            continue
        outs = _rule(node, centers, ball).apply(node, args, centers, ball)
        for o, v in zip(node.outputs, outs, strict=False):
            if o and v is not None:
                values[o] = v if half is None or not isinstance(v, LocalValue) else \
                    integrated(v, half.get(o), ball)
        if forms is not None:
            forms.step(node, node.inputs, node.outputs)
        factor = _layer_factor(node, args, ball.norm)
        if factor is not None:
            layers.append((node.name, *factor))


def _rule(node: Node, centers: list[np.ndarray | None], ball: Ball) -> LocalRule:
    rule = LOCAL_RULES.get(node.op_type)
    if rule is None:
        raise LocalNotCertified(f"{node.op_type} node {node.name}: no local rule")
    for c in centers:
        if c is not None and c.size * ball.size > MAX_JACOBIAN_ENTRIES:
            raise LocalNotCertified(f"node {node.name}: the Jacobian enclosure would hold "
                                    f"{c.size * ball.size} entries (limit "
                                    f"{MAX_JACOBIAN_ENTRIES})")
    return rule


# the margins past a final LayerNorm with its product deferred past the head (deferred.py)
DEFER = True

# Relational value ranges (affine.py) in lockstep with the enclosure: they keep the value
# ranges from compounding through LayerNorm and attention (docs/local-affine.md, "Affine value
# forms").
AFFINE = True


class _Forms:
    """The affine forms of the walk's tensors (affine.py): each op's inputs are narrowed to
    the enclosure's ranges, its outputs' enclosures intersected with the forms' ranges."""

    def __init__(self, ball: Ball, values: Values, env: dict[str, torch.Tensor],
                 count: dict[str, int], output: str) -> None:
        self.ball, self.values, self.env = ball, values, env
        self.forms: dict[str, affine.Aff] = {}
        self.count, self.output = count, output  # forms are dropped after their last use

    def _form(self, name: str) -> affine.Aff | None:
        v = self.values.get(name)
        if not isinstance(v, LocalValue):
            return None
        f = self.forms.get(name)
        if f is None:
            return affine.interval(v.center, center_margin(v.center), v.lo, v.hi,
                                   self.ball.size)
        if f.masked is not None:  # the mask's entries hold no values: nothing to narrow by
            return f
        return affine.narrow(f, v.lo, v.hi, self.ball)

    def tokens(self, name: str) -> None:
        """The token radii of a checkpoint's input, intersected with its form's."""
        v, f = self.values.get(name), self.forms.get(name)
        if not isinstance(v, LocalValue) or f is None or \
                f.shape != v.shape or not v.shape:
            return
        true = affine.token_radius(f, self.ball)
        if not np.all(np.isfinite(true)):
            return
        set_token_radius(v, true if v.tok_true is None else np.minimum(v.tok_true, true))

    def step(self, node: Node, ins: list[str], outs: list[str],
             chain: fused.Chain | None = None) -> None:
        args: list = []
        for i in ins:
            f = self._form(i) if i else None
            args.append(f if f is not None else None if not i else
                        self.values[i] if i in self.values else
                        (self.env[i].detach().numpy() if i in self.env else None))
        centers = [None if not o or o not in self.env else self.env[o].detach().numpy()
                   for o in outs]

        def ranges_of(k: int) -> tuple[np.ndarray, np.ndarray] | None:
            v = self.values.get(ins[k])
            return (v.lo, v.hi) if isinstance(v, LocalValue) else None
        try:
            res = affine_rules.step(node, args, centers, self.ball, ranges_of, chain,
                              _chain_consts(chain, self.env) if chain is not None else None)
        except affine.NotAffine:
            return
        finally:
            affine_rules.release(self.forms, self.count, ins, self.output)
        for o, f in zip(outs, res, strict=False):
            v = self.values.get(o) if o else None
            if f is None or not isinstance(v, LocalValue) or f.shape != v.shape:
                continue
            if f.masked is not None:  # kept for the Softmax that reads it, never intersected
                self.forms[o] = f
                continue
            lo, hi = affine.ranges(f, self.ball)
            if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
                continue
            self.values[o] = dataclasses.replace(
                v, lo=np.minimum(np.maximum(v.lo, lo), v.center),
                hi=np.maximum(np.minimum(v.hi, hi), v.center))
            self.forms[o] = f


def _checkpoint(node: Node, values: Values, ball: Ball, tight: _Telescope,
                half: Values | None = None, forms: _Forms | None = None) -> None:
    """Tighten the inputs of a range-sensitive op (CHECKPOINTS; products only of two
    input-dependent tensors) by telescoping."""
    if node.op_type not in CHECKPOINTS or (
            node.op_type in ("Mul", "MatMul", "Div") and
            sum(isinstance(values.get(i), LocalValue) for i in node.inputs if i) < 2):
        return
    for i in node.inputs:
        v = values.get(i) if i else None
        if isinstance(v, LocalValue):
            t = tight.tighten(i, v, values, ball, tokens=True)
            values[i] = t if half is None else integrated(t, half.get(i), ball)
            if forms is not None:
                forms.tokens(i)


def _walk_chain(node: Node, chain: fused.Chain, values: Values, env: dict[str, torch.Tensor],
                ball: Ball, tight: _Telescope | None) -> tuple[str, str, float, str]:
    """Bound a fused elementwise chain at its sink node; returns its reported factor."""
    root = values.get(chain.root)
    if not isinstance(root, LocalValue):
        raise LocalNotCertified(f"the elementwise chain ending at {node.name} has an "
                                "input-independent root")
    if tight is not None:
        root = values[chain.root] = tight.tighten(chain.root, root, values, ball, tokens=True)
    values[chain.sink] = _fused(chain, root, env, ball)
    dlo, dhi = fused.ranges(chain, _chain_consts(chain, env), root.lo, root.hi)[1]
    f = float(np.max(np.maximum(np.abs(dlo), np.abs(dhi)))) * (1 + LIBM_REL) + 1e-300
    ops = "/".join(nd.op_type for nd in chain.nodes)
    return (node.name, "activation:fused", f,
            f"local elementwise chain ({ops}): largest slope over the input's range")


def _chain_consts(chain: fused.Chain, env: dict[str, torch.Tensor]) -> dict[str, float]:
    inner = {n.outputs[0] for n in chain.nodes}
    return {i: float(env[i].reshape(())) for nd in chain.nodes for i in nd.inputs
            if i and i in env and env[i].numel() == 1 and i != chain.root and i not in inner}


def _chains(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor]
            ) -> tuple[dict[str, fused.Chain], set[str]]:
    variable = {model.spec.input_name}
    nodes: list[Node] = list(module.runtime_nodes)  # type: ignore[arg-type]
    for nd in nodes:
        if nd.op_type not in ("Shape", "Size") and any(i in variable for i in nd.inputs if i):
            variable.update(o for o in nd.outputs if o)
    return fused.find_chains(nodes, env, variable, {model.spec.output_name})


def _fused(chain: fused.Chain, x: LocalValue, env: dict[str, torch.Tensor],
           ball: Ball) -> LocalValue:
    """y = f(x) for a fused chain: elementwise with f' from interval differentiation."""
    consts = _chain_consts(chain, env)

    def d(c: np.ndarray) -> np.ndarray:
        lo, hi = fused.evaluate(chain, consts, c, c)[1]
        return 0.5 * (lo + hi)

    def rng(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return fused.ranges(chain, consts, lo, hi)[1]

    def curv(lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
        r = fused.second(chain, consts, lo, hi)
        return None if r is None else np.maximum(np.abs(r[0]), np.abs(r[1]))

    def curv2(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return fused.second(chain, consts, lo, hi)

    vals = fused.ranges(chain, consts, x.lo, x.hi)[0]
    out = env[chain.sink].detach().numpy()
    return elementwise(x, "fused", out, ball, deriv=(d, rng), values=vals, curv=curv,
                       curv2=curv2)


# Relative allowance on the adjoints G computed by autograd in float64 at the centre (they
# only scale remainder terms): far above float64 backward-pass rounding.
ADJOINT_MARGIN = 1e-9


def _adjoint_rows(target: torch.Tensor, ts: list[torch.Tensor]) -> list:
    """d target[i] / d t for every entry i and tensor t (None where t does not reach it):
    one batched backward pass (vmap over the rows of the identity), or row by row where an
    op has no batching rule."""
    k = target.numel()
    try:
        eye = torch.eye(k, dtype=target.dtype)
        grads = torch.autograd.grad(target, ts, grad_outputs=eye, retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        return [tuple(None if gr is None else gr[i] for gr in grads) for i in range(k)]
    except RuntimeError:
        return [torch.autograd.grad(target[i], ts, retain_graph=True, allow_unused=True)
                for i in range(k)]


class _Telescope:
    """The remainder of a tensor's Jacobian by telescoping over the ops before it:
    J_t(X) - J_t(X0) = sum_ops G_op (D_op(X) - D_op(X0)) J_in(X), G_op = d t / d (op output)
    at X0 (downstream ops at the centre, their cancellations kept), each op's term from its
    local rule; plus the rounding of the centre Jacobian (the enclosure at eps = 0)."""

    def __init__(self, model: OnnxModel, x: np.ndarray, zero: Values) -> None:
        module = model.module.with_dtype(torch.float64)
        self.xt = torch.from_numpy(x).requires_grad_(True)
        self.env = module.run_env(self.xt)
        self.zero = zero
        # the adjoint rows of the last (tensor, ops) asked for: the output is asked several
        # times (entrywise, margins, structured)
        self.cache: dict[tuple[str, tuple[str, ...]], list] = {}
        self.signed_terms = True
        self.output = model.spec.output_name
        self.terms_memo: list[tuple[tuple, tuple, list]] = []
        # u.term(ga) per (term, adjoint bound): tighten asks for the same product three times
        # on the 2-ball (remainder, row bounds, operator-norm rows)
        self.plain_memo: dict[tuple[int, int], tuple[object, np.ndarray, np.ndarray]] = {}

    def _terms(self, name: str, values: Values, combos: np.ndarray | None) -> list | None:
        """(|G| with its margin, the op's value, G) per op with a remainder term, G the
        adjoint of `name` (or of combos @ name) w.r.t. the op's output at X0. The last two
        answers are kept: tighten, the margins and structured ask for the same terms, and the
        signed forms (signed.bind) are the hot path."""
        z = self.zero.get(name)
        if not isinstance(z, LocalValue) or name not in self.env:
            return None
        names = [t for t, u in values.items()
                 if isinstance(u, LocalValue) and u.term is not None and t in self.env]
        if not names:
            return None
        # keyed by the value objects themselves (held by the memo, so compared by identity
        # without an id being reused): a tensor tightened since, or walked on another ball
        # (the halvings), is a new LocalValue
        vals = tuple(values[t] for t in names)
        memo_key = (name, tuple(names),
                    None if combos is None else (combos.shape, combos.tobytes()),
                    self.signed_terms)
        for k, held, got in self.terms_memo:
            if k == memo_key and all(a is b for a, b in zip(held, vals, strict=True)):
                return got
        key = (name, tuple(names))
        if key not in self.cache:
            target = self.env[name].reshape(-1)
            ts = [self.env[t] for t in names]
            self.cache = {key: _adjoint_rows(target, ts)}
        rows = self.cache[key]
        ts = [self.env[t] for t in names]
        # the output's own rows may use the signed forms' larger budget (signed.py)
        cap = signed.RELATIONAL_CAP.set(
            signed.RELATIONAL_OUTPUT_MAX_ENTRIES if name == self.output else None)
        try:
            out = self._bound_terms(names, ts, rows, values, combos)
        finally:
            signed.RELATIONAL_CAP.reset(cap)
        self.terms_memo = [(memo_key, vals, out), *self.terms_memo[:1]]
        return out

    def plain(self, u: LocalValue, ga: np.ndarray) -> np.ndarray:
        """u.term(ga), computed once per (term, |G| bound) pair while both are held (the
        memo keeps them, so their ids are not reused); read-only, as it is shared."""
        term = u.term
        assert term is not None
        key = (id(term), id(ga))
        got = self.plain_memo.get(key)
        if got is not None and got[0] is term and got[1] is ga:
            return got[2]
        res = term(ga)
        res.flags.writeable = False
        if len(self.plain_memo) >= PLAIN_MEMO:
            self.plain_memo.clear()
        self.plain_memo[key] = (term, ga, res)
        return res

    def _bound_terms(self, names: list[str], ts: list[torch.Tensor], rows: list,
                     values: Values, combos: np.ndarray | None) -> list:
        """The (|G| + margin, signed-bound value, G) triples of `_terms` from the adjoint
        rows."""
        out = []
        for j, t in enumerate(names):
            if all(r[j] is None for r in rows):
                continue
            zero_g = np.zeros(tuple(ts[j].shape))
            g = np.stack([zero_g if (gi := r[j]) is None else gi.detach().numpy()
                          for r in rows])
            if combos is not None:
                g = np.tensordot(combos, g, axes=1)  # (M, *S_t)
            ga = np.abs(g) * (1 + ADJOINT_MARGIN) + ADJOINT_MARGIN * float(np.abs(g).max())
            u = values[t]
            assert isinstance(u, LocalValue) and u.term is not None
            # the signed form where a rule has one
            b = signed.bind(u, g, ga) if self.signed_terms else u
            out.append((ga, b, g))
        return out

    def opnorm(self, name: str, values: Values, combos: np.ndarray | None = None,
               groups: list[np.ndarray] | None = None) -> np.ndarray | None:
        """Per row of `name` (or of combos @ name) as one matrix when `combos` is None, else
        per combination: a bound on sup ||J(X) - jc||_2 over the 2-ball from the
        operator-norm terms (opnorm.py): each op's term is the smaller of its opnorm rule
        (signed adjoint; its rounding margin through the entrywise term) and the 2-norm of
        its entrywise term; plus the rounding of jc. Returns (1,) for the whole matrix, or
        (M,) per combination, or per group of rows (index arrays) when `groups` is given.
        None: nothing to telescope."""
        terms = self._terms(name, values, combos)
        if terms is None:
            return None
        rnd = self._rounding(name, combos)
        if groups is None:
            groups = [np.arange(rnd.shape[0])] if combos is None else \
                [np.array([r]) for r in range(combos.shape[0])]
        try:
            return rows_bound(terms, rnd, groups, ADJOINT_MARGIN, self.plain)
        except (ValueError, np.linalg.LinAlgError):  # a term overflowed: not finite
            return None

    def whole_opnorm(self, name: str, values: Values, ball: Ball) -> float | None:
        """2-ball: the operator-norm remainder of the whole tensor; None otherwise."""
        if ball.norm != "2":
            return None
        rem = self.opnorm(name, values)
        return None if rem is None else float(rem[0])

    def _rounding(self, name: str, combos: np.ndarray | None) -> np.ndarray:
        """|J(X0) - jc| for the rows: the enclosure's radius at eps = 0."""
        z = self.zero[name]
        assert isinstance(z, LocalValue)
        zr = z.jr.reshape(z.center.size, -1)
        return zr if combos is None else np.abs(combos) @ zr

    def remainder(self, name: str, values: Values, ball: Ball,
                  combos: np.ndarray | None = None) -> np.ndarray | None:
        """The telescoped bound on |J_t(X) - jc_t| for every entry of tensor `name`, (k, P);
        with `combos` (M, k), for the rows combos @ t instead (their adjoints combined before
        the absolute values, so cancellations between the entries are kept). None: nothing
        to telescope."""
        terms = self._terms(name, values, combos)
        if terms is None:
            return None
        total = self._rounding(name, combos).copy()
        for ga, u, _ in terms:
            assert u.term is not None
            total += self.plain(u, ga)
        return total * (1 + 1e-12)

    def structured(self, name: str, values: Values, ball: Ball,
                   combos: np.ndarray | None = None) -> Structured | None:
        """Norm bounds on J_t(X) - jc_t from the factored terms (structured.py)."""
        terms = self._terms(name, values, combos)
        if terms is None:
            return None
        kept = [(ga, u, g) for ga, u, g in terms if u.term is not None]
        tl = [(self.plain(u, ga), None if u.parts is None else u.parts(ga))
              for ga, u, _ in kept]
        zr = self._rounding(name, combos)
        try:
            st = structured_bounds(tl, zr, ball.norm)
        except ValueError:  # a term overflowed (not finite): the entrywise bound stands
            return None
        # inf-ball rows with the signs of the rows' own Jacobians kept (signed.py)
        rem = self.remainder(name, values, ball, combos)
        v = values.get(name)
        st = signed.signed_rows(st, tl, zr, v, combos, rem, ball.norm)
        if ball.norm != "inf" or not isinstance(v, LocalValue) or not kept:
            return st
        # and the rows' Hessians at X0 from the ops' second-order rules (second.py)
        jcm, jrr, err = signed.row_enclosure(v, combos, rem)
        return second.second_rows(st, [(g, ga, u, b) for (ga, u, g), (b, _) in
                                       zip(kept, tl, strict=True)],
                                  widen_up(zr + err, 2), jcm, jrr, ball.eps)

    def tighten(self, name: str, v: LocalValue, values: Values, ball: Ball,
                tokens: bool = False) -> LocalValue:
        total = self.remainder(name, values, ball)
        if total is None:
            return v
        jr = np.minimum(v.jr, total.reshape(v.jr.shape))
        lo, hi = v.lo, v.hi
        nonlin = v.nonlin
        if ball.norm == "inf":  # the entries' second-order enclosure (second.py)
            got = self._second_entries(name, values, ball)
            if got is not None:
                hrow, rest = second.hessian_rows(np.abs(got[0])), got[1]
                h = second.entry_bounds(hrow, rest, ball.eps)
                if np.all(np.isfinite(h)):
                    jr = np.minimum(jr, h.reshape(v.jr.shape))
                # and the values' (second.value_radius)
                rad, nl = second.value_radius(hrow, rest, v.jc, ball.eps)
                if np.all(np.isfinite(rad)):
                    rad = widen_up(rad.reshape(v.center.shape) + center_margin(v.center), 2)
                    lo, hi = np.maximum(lo, v.center - rad), np.minimum(hi, v.center + rad)
                    nonlin = (ball.eps, nl.reshape(v.center.shape))
        if ball.norm == "2":
            # values from the structured row bounds: |T_i(X) - T_i(X0) - jc_i d| <=
            # eps sup ||J_i(xi) - jc_i||_2 (mean value theorem; structured.py)
            terms = self._terms(name, values, None)
            assert terms is not None
            try:
                rows = row_two_bounds([(self.plain(u, ga),
                                        None if u.parts is None else u.parts(ga))
                                       for ga, u, _ in terms if u.term is not None],
                                      self._rounding(name, None))
            except ValueError:  # not finite
                rows = None
            if rows is not None:
                p = v.jc.shape[-1]
                lin = np.sqrt(widen_up(np.square(v.jc.reshape(-1, p)).sum(axis=1), p)) \
                    * (1 + 4 * U)
                rad = widen_up(ball.eps * (lin + rows), 4).reshape(v.center.shape) \
                    + center_margin(v.center)
                lo, hi = np.maximum(lo, v.center - rad), np.minimum(hi, v.center + rad)
        out = enclose(v.center, v.jc, jr, ball, lo, hi)
        out.term, out.opnorm, out.second, out.jfac = v.term, v.opnorm, v.second, v.jfac
        out.nonlin = nonlin
        if ball.norm == "2" and tokens:
            self._norms(name, out, values, ball)
        return out

    def _second_entries(self, name: str, values: Values, ball: Ball
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """inf-ball: the entries' Hessians at X0 and rest (second.hessian_rest), from the ops'
        second-order rules (second.py): |J_t(X) - jc_t - H[p] . d| <= r entrywise; None
        where no op has one or they would not fit."""
        z = self.zero.get(name)
        if not isinstance(z, LocalValue) or \
                z.center.size * z.jc.shape[-1] ** 2 > second.MAX_TENSOR_HESSIAN_ENTRIES:
            return None
        terms = self._terms(name, values, None)
        if terms is None:
            return None
        kept = [(g, ga, u, self.plain(u, ga)) for ga, u, g in terms if u.term is not None]
        return second.hessian_rest(kept, self._rounding(name, None), ball.eps,
                                   second.MAX_TENSOR_HESSIAN_ENTRIES)

    def _norms(self, name: str, v: LocalValue, values: Values, ball: Ball) -> None:
        """2-ball: v.jnorm = ||jc||_2 + the operator-norm remainder of the whole tensor, and
        per token t (last axis) v.tok_rad = eps (||jc_t||_2 + remainder of its rows) + the
        centre's margin (mean value theorem: ||T_t(X) - T_t(X0)|| <= eps sup ||J_t||_2)."""
        d = v.shape[-1] if v.shape else 1
        k = v.center.size
        rows = np.arange(k)
        groups = [rows] + [rows[i:i + d] for i in range(0, k, d)]
        rem = self.opnorm(name, values, None, groups)
        if rem is None:
            return
        p = v.jc.shape[-1]
        jc = v.jc.reshape(k, p)
        v.jnorm = add_up(spectral_norm_upper(jc), float(rem[0]))
        if not v.shape:
            return
        tok = np.array([add_up(spectral_norm_upper(jc[i:i + d]), float(rem[1 + t]))
                        for t, i in enumerate(range(0, k, d))])
        v.tok_jn = tok.reshape(*v.shape[:-1], 1)
        set_token_radius(v, widen_up(ball.eps * v.tok_jn, 2))


def _layer_factor(node: Node, args: list, norm: str) -> tuple[str, float, str] | None:
    """A reported per-layer local factor (what dominates; the certificate is the whole-graph
    enclosure): LayerNorm's constant on the ball from a lower bound on each token's centred
    norm, an activation's largest slope over its input range."""
    x = args[0] if args else None
    if not isinstance(x, LocalValue):
        return None
    if node.op_type == "LayerNormalization" and isinstance(args[1], np.ndarray):
        d = x.shape[-1]
        eps = decimal_attr(float(node.attrs.get("epsilon", 1e-5)))
        pc = x.center - x.center.mean(axis=-1, keepdims=True)
        cn = np.sqrt(np.square(pc).sum(axis=-1)) * (1 - 4 * U)  # ||P x0_i||, rounded down
        rho = np.sqrt(np.square(x.rad).sum(axis=-1)) * (1 + 4 * U)  # ||x - x0|| per token
        low = np.maximum(cn - rho, 0.0)
        sigma = np.sqrt((low * low / d + eps) * (1 - 4 * U)) * (1 - 2 * U)
        gmax = float(np.abs(args[1]).max())
        f = float(np.max(gmax / sigma)) * (1 + 8 * U)
        if norm == "inf":
            f = mul_up(f, sqrt_up(d))
        return ("layernorm", f, "local LayerNorm: max|gamma| / sqrt(max(0, ||P x0|| - rho)^2"
                "/D + eps) per token" + (" x sqrt(D) (inf)" if norm == "inf" else ""))
    op = activation(node.op_type, node.attrs)  # lsa_models/operators/
    if op is None:
        return None
    try:
        dlo, dhi = op.d1_range(x.lo, x.hi)
    except ModeNotImplemented:
        return None
    f = float(np.max(np.maximum(np.abs(dlo), np.abs(dhi)))) * (1 + LIBM_REL) + 1e-300
    return (f"activation:{op.kind}", f, f"local {op.kind}: largest slope over the input's range")
