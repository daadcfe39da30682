"""The local engine's value type: what is known about one tensor over the ball.

The ball is `{X : ||X - X0||_p <= eps}` (p = 2: Frobenius norm of the whole input; p = inf:
largest entry). Every input-dependent tensor T carries
  - `center`: T(X0), computed in float64;
  - `lo`, `hi`: an enclosure of every entry of T(X) over the ball;
  - `jc`, `jr`: a Jacobian enclosure, `dT/dX (X) in jc +- jr` entrywise for every X in the
    ball, stored with the tensor's shape first and the input's P = numel(X0) entries last:
    (*shape, P). `jc` is the exact Jacobian at X0 up to rounding (docs/local-enclosure.md).
Tensors that do not depend on the input are plain float64 arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np

from lsa_models.bounds.numerics import U

# Relative margin on the centre values of every tensor: covers the rounding of the float64
# forward pass at X0 (docs/local-rounding.md, "Rounding"). The smallest one used; a run whose
# forward error is proven larger (rounding/forward_error.py) uses that proven one instead.
FORWARD_MARGIN = 1e-9
# Absolute floor of that margin, relative to the tensor's largest centre entry.
FORWARD_FLOOR = 1e-9
# The margin m of the current engine run: |T(X0) - c_T| <= m |c_T| + m max|c_T|
MARGIN: ContextVar[float] = ContextVar("forward_margin", default=FORWARD_MARGIN)


class LocalNotCertified(Exception):
    """An op (or a value range) for which the local engine has no certified enclosure."""


@dataclass(frozen=True)
class Ball:
    """The perturbation domain {X : ||X - X0||_norm <= eps}: centre X0 (in the graph input's
    shape), radius eps >= 0, norm "2" (Frobenius over the whole input) or "inf"."""

    center: np.ndarray
    eps: float
    norm: str  # "2" | "inf"

    @property
    def size(self) -> int:
        return int(self.center.size)


Parts = tuple[np.ndarray, np.ndarray, np.ndarray]
Term = Callable[[np.ndarray], np.ndarray]
PartsFn = Callable[[np.ndarray], list[Parts]]


@dataclass(frozen=True)
class OpRemainder:
    """The remainder term of the op that produced a tensor T (*S,) and its other forms, all
    bounding the one quantity R(G) = G (D_op(X) - D_op(X0)) J_in(X) over the ball, with D_op
    the op's local Jacobian and J_in its input's Jacobian; the forms of one object belong to
    one op, so a rule that changes the term builds a new one (frozen).
      - term: ga -> a nonnegative (K, P) bound on |R(G)| for any adjoint G (K, *S) with
        |G| <= ga (the telescope's G = d out / d T at X0; signed.bind's bound holds for its
        one G only). A signed.SignedTerm where the rule also has the signed form.
      - parts: the same bound factored (remainders/structured_norms.py): for |G| (K, *S), a list of
        (c, jc_in, jr_in), c (K, n) >= 0, the op's input Jacobian jc_in +- jr_in (n, P),
        with |R(G)| <= sum_b c_kb |J_in,b(X)| row by row. None: not factored.
      - opnorm: G -> a float >= sup ||R(G)||_2 over a 2-ball for the signed adjoint G
        (remainders/operator_norms.py). None: no such rule.
      - second: the op's second-order rule for the inf-ball's rows (remainders/second_order.py,
      SecondFn).
        None: no such rule."""

    term: Term
    parts: PartsFn | None = None
    opnorm: Callable[[np.ndarray], float] | None = None
    second: Callable[..., tuple[np.ndarray, np.ndarray]] | None = None


@dataclass
class LocalValue:
    """What the local engine knows about one input-dependent tensor T over the ball.

    The enclosure (always set; the walk's contract, docs/local-enclosure.md): for every X in
    the ball, lo <= T(X) <= hi and |dT/dX (X) - jc| <= jr entrywise, with center the
    computed T(X0) (within center_margin(center) of the true one) and lo <= center <= hi.

    The rest are optional annotations, each valid exactly as stated below; None says nothing.

    `remainder` (OpRemainder, below): the op's remainder term and its other forms, set by the
    rule that produced T (enclosure/rules.py, enclosure/primitives.py, enclosure/rules_more.py) and
    read by the telescope (remainders/telescope.py) when T is one of the ops summed over. None: the
    op is linear.

    The 2-ball's norms, set where the walk tightens T (telescope.Telescope._norms, with
    opnorm.set_token_radius; jacobian_walk's affine forms and the integrated form narrow the
    token radii) and read by the rules of the ops T feeds (remainders/operator_norms.py,
    enclosure/rules.py, enclosure/primitives.py); all per token t = a row of the last axis, shaped
    (*S[:-1], 1):
      - jnorm >= sup ||dT/dX (X)||_2 over the ball (a float);
      - tok_jn >= sup ||dT_t/dX (X)||_2;
      - tok_true >= ||T_t(X) - T_t(X0)||_2 (the true centre);
      - tok_rad >= ||T_t(X) - center_t||_2 (tok_true plus the centre's margin), and every
        entry of lo, hi within tok_rad of the centre.

    The inf-ball's second-order annotations (remainders/second_order.py):
      - nonlin: (eps, b), set where the walk tightens T with second-order rules
        (telescope.Telescope.tighten, second.value_radius): b (*S,) >=
        |T(X) - T(X0) - jc . (X - X0)| over the ball of radius eps, for jc as it is here;
      - jfac: (M (*S, B), dmb (B,), src (B, P), rest (*S, P)), set by elementwise ops and
        carried through linear and layout ones (enclosure/rules.py, enclosure/primitives.py): for
        every X in the ball, J(X) - jc = M diag(delta) src + R with |delta_b| <= dmb_b and |R| <=
        rest.
    """

    center: np.ndarray  # (*S,)
    lo: np.ndarray  # (*S,)
    hi: np.ndarray  # (*S,)
    jc: np.ndarray  # (*S, P)
    jr: np.ndarray  # (*S, P), >= 0
    remainder: OpRemainder | None = field(default=None, repr=False)
    # the 2-ball's norms (above)
    jnorm: float | None = field(default=None, repr=False)
    tok_rad: np.ndarray | None = field(default=None, repr=False)
    tok_jn: np.ndarray | None = field(default=None, repr=False)
    tok_true: np.ndarray | None = field(default=None, repr=False)
    # the inf-ball's second-order annotations (above)
    nonlin: tuple[float, np.ndarray] | None = field(default=None, repr=False)
    jfac: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = \
        field(default=None, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.center.shape)

    @property
    def term(self) -> Term | None:
        """The op's remainder term (OpRemainder.term); None: the op is linear."""
        return None if self.remainder is None else self.remainder.term

    @property
    def parts(self) -> PartsFn | None:
        """The op's remainder term factored (OpRemainder.parts), where the rule gives it."""
        return None if self.remainder is None else self.remainder.parts

    @property
    def rad(self) -> np.ndarray:
        """Largest distance from the centre to the enclosure, entrywise (*S,)."""
        return np.maximum(self.hi - self.center, self.center - self.lo)


# the walk's values by tensor name: a LocalValue where the tensor depends on the input, else
# its float64 array
Values = dict[str, LocalValue | np.ndarray]


def gamma(k: int) -> float:
    """gamma_k = k u / (1 - k u) (Higham): relative error bound of a k-term float64 sum of
    products; inflated by 2 for the extra roundings of the enclosure arithmetic."""
    k = max(int(k), 2) + 2
    return 2.0 * k * U / (1.0 - k * U)


# The absolute floor every upward widening adds (covers a result that underflowed). Not the
# smallest normal float (2.2e-308): the enclosures are full of such floors where a Jacobian
# entry is exactly 0 (a token's rows before attention), and their products with ordinary
# entries are subnormal, which x86 computes ~30x slower (a 128 x 128 remainder term product:
# 6.7 ms against 0.23 ms). FLOOR x anything above 1e-127 stays normal and FLOOR x FLOOR
# underflows to 0 at full speed; as a bound it is only larger, so every widening stays sound.
FLOOR = 2.0**-600


def widen_up(x: np.ndarray, k: int) -> np.ndarray:
    """A nonnegative quantity computed with at most k roundings per entry, pushed up."""
    return x * (1.0 + gamma(k)) + FLOOR


def dual_row_norms(absjac: np.ndarray, norm: str) -> np.ndarray:
    """For |J| + R with shape (*S, P): the dual norm of every row (ell_1 for the inf-ball,
    ell_2 for the 2-ball), rounded up: bounds |grad T_i . dX| <= norm * ||dX||_p."""
    p = absjac.shape[-1]
    if norm == "inf":
        return widen_up(absjac.sum(axis=-1), p)
    return np.sqrt(widen_up(np.square(absjac).sum(axis=-1), p)) * (1.0 + 4 * U)


# Proven entrywise forward errors of the graph's tensors for the current run, by the address,
# shape and strides of their centre arrays (the float64 evaluation's own buffers)
# (the graph's buffers stay alive for the whole run, so their addresses are not reused; an
# array a rule forms is registered with itself as owner and matched by identity)
Key = tuple[int, tuple[int, ...], tuple[int, ...]]
PROVEN: ContextVar[dict[Key, tuple[np.ndarray | None, np.ndarray]] | None] = \
    ContextVar("proven_forward_errors", default=None)


def array_key(a: np.ndarray) -> Key:
    return (int(a.__array_interface__["data"][0]), tuple(a.shape), tuple(a.strides))


def _margin(center: np.ndarray) -> np.ndarray:
    """|T(X0) - c_T| <= this: the proven entrywise error of a graph tensor when known, else
    m |c_T| + m max|c_T| with the run's margin m."""
    known = PROVEN.get()
    hit = known.get(array_key(center)) if known and center.size else None
    if hit is not None and (hit[0] is None or hit[0] is center) \
            and hit[1].shape == center.shape:
        return hit[1]
    scale = float(np.max(np.abs(center))) if center.size else 0.0
    m = MARGIN.get()
    return m * np.abs(center) + m * scale


def center_margin(center: np.ndarray) -> np.ndarray:
    """How far the computed centre value may be from the true T(X0) (the forward margin)."""
    return widen_up(_margin(center), 4)


def enclose(center: np.ndarray, jc: np.ndarray, jr: np.ndarray, ball: Ball,
            lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> LocalValue:
    """The mean-value enclosure T(X) in T(X0) +- eps * ||row of |jc| + jr||_dual, widened by
    the forward margin, intersected with a natural range [lo, hi] when the op knows one."""
    center = np.asarray(center, dtype=np.float64)
    if not np.all(np.isfinite(center)):
        raise LocalNotCertified("a tensor is not finite at the centre")
    rows = dual_row_norms(np.abs(jc) + jr, ball.norm)
    rad = widen_up(ball.eps * rows + _margin(center), 4)
    mlo, mhi = center - rad, center + rad
    if lo is not None:
        mlo = np.maximum(mlo, lo)
    if hi is not None:
        mhi = np.minimum(mhi, hi)
    return LocalValue(center, np.minimum(mlo, center), np.maximum(mhi, center), jc, jr)


def input_value(ball: Ball) -> LocalValue:
    """The input itself: Jacobian the identity, exactly."""
    p = ball.size
    jc = np.eye(p).reshape(*ball.center.shape, p)
    c = ball.center.astype(np.float64)
    known = PROVEN.get()
    if known is not None:  # X0 itself is exact
        known[array_key(c)] = (c, np.zeros_like(c))
    return enclose(c, jc, np.zeros_like(jc), ball)


def box_to_two(a: np.ndarray) -> np.ndarray:
    """sup ||a e||_2 over e in [-1, 1]^Q for every (..., D, Q) block: the smallest of the sum of
    its columns' norms, the norm of its rows' l1 sums and the weighted spectral bound: with
    c_q = ||a_q||_2 > 0, ||a e||^2 = ||a C^-1/2 (C^1/2 e)||^2 <= lambda_max(a C^-1 a^T) sum c_q
    (the Gram matrix's largest eigenvalue, on the smaller side; LAPACK's, plus 64 (D + Q) u
    trace for its and the products' errors)."""
    d, q = a.shape[-2], a.shape[-1]
    cn = np.sqrt(np.einsum("...dq,...dq->...q", a, a))  # (..., Q); one pass, no a**2 copy
    cols = widen_up(cn.sum(axis=-1), q + d)
    rows = widen_up(np.sqrt(np.square(np.abs(a).sum(axis=-1)).sum(axis=-1)), q + d)
    w = np.where(cn > 0, 1.0 / np.where(cn > 0, cn, 1.0), 0.0)
    s = a * np.sqrt(w)[..., None, :]  # a C^-1/2
    # the same nonzero eigenvalues: a C^-1 a^T (D x D) or C^-1/2 a^T a C^-1/2 (Q x Q)
    gram = np.swapaxes(s, -1, -2) @ s if q < d else s @ np.swapaxes(s, -1, -2)
    lam = np.linalg.eigvalsh(gram)[..., -1]
    tr = np.trace(gram, axis1=-2, axis2=-1)
    lam = widen_up(np.maximum(lam, 0.0) + 64 * (d + q) * U * tr, 4)
    spec = np.sqrt(widen_up(lam * cols, 2)) * (1 + 4 * U)
    return np.minimum(np.minimum(cols, rows), spec)
