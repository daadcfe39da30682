"""The radius sweep (docs/local-robustness.md, "Certified robustness radius"): margin
constants L_j(r) on growing balls, from the Jacobian enclosure and the adjoint graph,
integrated along the segment from the centre; its passes and their order are routes/table.py's.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from lsa_models.engine.derived.adjoint import AdjointGraph
from lsa_models.engine.drivers.jacobian import LocalJacobian, local_jacobian
from lsa_models.engine.routes.budget import Budget
from lsa_models.engine.routes.constant import adjoint_bounds, output_size
from lsa_models.engine.routes.errors import NOT_APPLICABLE
from lsa_models.onnx.loading import OnnxModel


def _pair_constants(lj: LocalJacobian, label: int) -> dict[int, float]:
    """For every j != label: an upper bound on sup ||grad (f_label - f_j)||_dual over the
    ball (dual: ell_2 for the 2-ball, ell_1 for the inf-ball), from the enclosure rows."""
    out = {}
    p = lj.jc.shape[1]
    for j in range(lj.jc.shape[0]):
        if j == label:
            continue
        g = np.abs(lj.jc[label] - lj.jc[j]) * (1 + 2.0**-52)
        r = (lj.jr[label] + lj.jr[j]) * (1 + 2.0**-52)
        if j in lj.margin_jr:  # both bound |grad m_j(X) - (jc_label - jc_j)|
            r = np.minimum(r, lj.margin_jr[j])
        if lj.ball.norm == "inf":
            v = float((g + r).sum()) * (1 + (p + 4) * 2.0**-52)
        else:
            v = math.sqrt(float(np.square(g + r).sum()) * (1 + (p + 4) * 2.0**-52)) \
                * (1 + 2.0**-51)
        if j in lj.margin_dual:  # the factored (structured) bound, when smaller
            v = min(v, lj.margin_dual[j])
        out[j] = v
    return out


@dataclass
class _EnclosureTurns:
    """One sweep's record of the enclosure against the adjoint graph: whether the enclosure
    won on some margin at the last ball both ran on, and the balls walked without it since."""

    won: bool = True
    skipped: int = 0


def _constants_at(om: OnnxModel, x: np.ndarray, r: float, norm: str, label: int,
                  turns: _EnclosureTurns | None = None, adjoint: bool = True
                  ) -> dict[int, float] | None:
    """L_j(r) >= sup ||grad (f_label - f_j)||_dual over the ball of radius r; None when the
    engine cannot enclose that ball. The smaller of the adjoint graph's (ADJOINT_NORMS) and
    the enclosure's per margin; with `turns` (a sweep's), the enclosure is skipped after the
    adjoint graph beat it on every margin at the last ball both ran on, and run again every
    ENCLOSURE_EVERY-th ball (a choice of time only; by counts within the sweep, not clocks
    or earlier calls, so radii are reproducible)."""
    adj = _adjoint_constants(om, x, r, norm, label) if adjoint and norm in ADJOINT_NORMS \
        else None
    consts: dict[int, float] = {}
    if adj is None or turns is None or turns.won or turns.skipped + 1 >= ENCLOSURE_EVERY:
        try:
            # without the engine's half-ball walk (driver.HALVINGS): in a sweep its
            # integrated values change the radii in the fourth digit for a third to a half of
            # each run's time
            lj = local_jacobian(om, x, r, norm, margins_of=label, halvings=0, whole=False)
            consts = _pair_constants(lj, label)
        except NOT_APPLICABLE:
            consts = {}
        consts = {j: v for j, v in consts.items() if math.isfinite(v)}
        if adj is not None and turns is not None:
            turns.won = any(consts.get(j, math.inf) < ENCLOSURE_WINS * v
                            for j, v in adj.items())
            turns.skipped = 0
    elif turns is not None:
        turns.skipped += 1
    if adj is not None:  # the smaller of the two, per margin
        consts = {j: min(v, consts.get(j, math.inf)) for j, v in adj.items()}
    if not consts:
        return None
    return {j: v * (1 + 1e-12) for j, v in consts.items()}


# the margins' gradients also through the adjoint graph (derived/adjoint.py), the smaller standing:
# on the inf-ball (several times below the enclosure's on larger balls); on the 2-ball it is
# smaller only on small balls and walks slower there (eigenvalues in every product): under
# 1% of radius for 3x the time, so it is off
ADJOINT_NORMS: tuple[str, ...] = ("inf",)
ENCLOSURE_EVERY = 8
# the enclosure "won" at a ball where it was below this fraction of the adjoint constant
ENCLOSURE_WINS = 0.99
_ADJ_CACHE: dict[tuple, tuple[OnnxModel, dict[int, AdjointGraph]]] = {}
_ADJ_LOCK = threading.Lock()


def _adj_key(om: OnnxModel, x: np.ndarray, label: int) -> tuple:
    return (id(om), hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest(), label)


def _adjoint_constants(om: OnnxModel, x: np.ndarray, r: float, norm: str, label: int
                       ) -> dict[int, float] | None:
    """sup ||grad (f_label - f_j)||_dual over the ball from the adjoint graphs (one per
    margin, built once per model, centre and label); None where they cannot be built or
    walked."""
    graphs = _adjoint_graphs(om, x, label)
    return adjoint_bounds(graphs, r, norm) if graphs else None


def _adjoint_graphs(om: OnnxModel, x: np.ndarray, label: int) -> dict[int, AdjointGraph]:
    """The margins' adjoint graphs, cached for one (model, centre, label) at a time (a radius
    job walks them at every ball). The entry holds the model itself and is matched by
    identity, so a later model at a reused address never gets another's graphs; concurrent
    jobs (threads) only evict each other's entries."""
    key = _adj_key(om, x, label)
    with _ADJ_LOCK:
        hit = _ADJ_CACHE.get(key)
    if hit is not None and hit[0] is om:
        return hit[1]
    built: dict[int, AdjointGraph] = {}
    try:
        k = output_size(om, x)
        for j in range(k):
            if j != label:
                c = np.zeros(k)
                c[label], c[j] = 1.0, -1.0
                built[j] = AdjointGraph(om, x, c)
    except NOT_APPLICABLE:
        built = {}  # an optional refinement: the enclosure's constants stand
    with _ADJ_LOCK:
        _ADJ_CACHE.clear()
        _ADJ_CACHE[key] = (om, built)
    return built


# the sweep's pieces: the first 1/16 of the first-order radius wide, then as wide as the last
# one (while that is more than SWEEP_RATIO - 1 of the radius reached) or SWEEP_RATIO - 1 of the
# radius reached; a piece that fails is retried a quarter as wide (SWEEP_SHRINK)
SWEEP_START, SWEEP_RATIO, SWEEP_SHRINK, SWEEP_MIN_GAIN = 1.0 / 16, 1.12, 0.25, 0.01
# after a certified piece the next is at least this fraction of what the margins left allow
# at its constants; a sweep stops within this fraction of the attack's radius
SWEEP_REACH, SWEEP_FLAT, SWEEP_CAP_TOL = 0.5, 1.02, 1e-3
# where the sweep probes the affine route's radius before it starts (`_sweep`'s `floor`)
SWEEP_PROBE = 0.75


def _tick(progress: Callable[[str, float], None] | None, runs: int, steps: int,
          certified: float) -> None:
    if progress is not None:
        progress(f"radius sweep {runs}/{steps}, certified {certified:.3g}", runs / steps)


def _sweep(om: OnnxModel, x: np.ndarray, norm: str, label: int, margins: dict[int, float],
           steps: int, progress: Callable[[str, float], None] | None = None,
           floor: float = 0.0, adjoint: bool = True, cap: float = math.inf,
           cut: list[bool] | None = None, budget: Budget | None = None
           ) -> tuple[float, int, dict[int, float]]:
    """The certified radius by the integrated mean value theorem (docs/local-robustness.md,
    "Certified robustness radius"): for radii 0 = rho_0 < rho_1 < ... and X with
    ||X - X0|| <= rho_n, every point of the segment at distance in (rho_{i-1}, rho_i] lies in
    the ball of radius rho_i, so
        m_j(X) >= m_j(X0) - sum_{i <= n} (rho_i - rho_{i-1}) L_j(rho_i).
    A piece (rho_n, rho_n + w] whose sum would reach a margin still certifies the partial
    width min_j (m_j(X0) - S_j) / L_j(rho_n + w) (the ball contains it), and is retried
    SWEEP_SHRINK as wide. Returns (radius, engine runs, L at the last certified piece).
    `floor`: a radius certified otherwise (reported in the progress as certified so far);
    `cap`: a radius known to flip the label (the attack's): the sweep stops within
    SWEEP_CAP_TOL of it. `cut`, when given, gets True appended where the sweep stopped
    because it cannot pass `floor`. `budget`: looked at before each engine run but the
    first; once it is spent the radius certified so far is returned."""
    turns = _EnclosureTurns()
    b = budget or Budget()
    began = b.clock()
    c0 = _constants_at(om, x, 0.0, norm, label, turns, adjoint)
    b.lap(began)
    _tick(progress, 1, steps, floor)
    # the centre's run encloses no ball (a twentieth of a run on one on the digits ViTs):
    # the next run is predicted from the budget's estimate of one
    b.last = max(b.last, b.sweep_run)
    if c0 is None or b.out("the radius sweep's runs", b.last):
        return 0.0, 1, {}
    runs0 = 1
    probe: tuple[float, dict[int, float]] | None = None  # a ball walked already
    if floor > 0:
        runs0 = 2
        # one probe of the other route's radius: the sweep's sum up to `floor` is at least
        # (1 - SWEEP_PROBE) floor L_j(SWEEP_PROBE floor) (the constants grow with the
        # radius), and over [0, SWEEP_PROBE floor] its pieces, each at its outer ball's
        # constant (a right sum of growing constants), spend about the trapezoid of L_j(0)
        # and the probe's; where that spends a margin the sweep will not pass `floor` (a
        # cutoff for time only: x-transformers' inf job 99 -> 50 s, the same radius)
        # (the engines the next piece would walk, by a copy of the sweep's turns, so the
        # pieces' schedule does not depend on the probe: the MLP's inf-ball, where the
        # adjoint graph beat the enclosure at the centre, probes with it alone: its job
        # 7% shorter; on the Transformers' inf-balls the first sweep walks
        # the enclosure alone, and so does its probe, see `robustness`)
        began = b.clock()
        cp = _constants_at(om, x, SWEEP_PROBE * floor, norm, label, replace(turns), adjoint)
        b.lap(began)
        _tick(progress, 2, steps, floor)
        if cp is not None and any(
                margins[j] <= SWEEP_PROBE * floor * 0.5 * (c0.get(j, 0.0) + cp[j])
                + (1 - SWEEP_PROBE) * floor * cp[j] for j in cp):
            _stopped(progress, floor, cut)
            return 0.0, 2, {}
        probe = None if cp is None else (SWEEP_PROBE * floor, cp)
    first = min(margins[j] / max(c0[j], 1e-300) for j in c0)
    spent = dict.fromkeys(c0, 0.0)  # S_j: the sum over the pieces so far
    prev, best, width, runs, consts = 0.0, 0.0, first * SWEEP_START, runs0, dict[int, float]()
    last_ok: dict[int, float] = {}  # the constants of the last certified piece
    fail: tuple[float, dict[int, float]] | None = None  # the last ball that spent a margin
    # stop when a piece would add less than SWEEP_MIN_GAIN of the radius reached
    while runs < steps and width > max(first * 1e-6, best * SWEEP_MIN_GAIN) \
            and not b.out("the radius sweep's next run", b.last):
        c: dict[int, float] | None
        walked = probe is None or not prev + 0.75 * width <= probe[0] < prev + width
        if not walked and probe is not None:
            # the probe's ball ends this piece (at least 3/4 as wide as planned): its
            # constants are known, no walk
            rho, c = probe
            width, probe = rho - prev, None
        else:
            runs += 1
            rho = prev + width
            began = b.clock()
            c = _constants_at(om, x, rho, norm, label, turns, adjoint)
            b.lap(began)
        after = None if c is None else {j: spent[j] + width * c[j] for j in c}
        if c is not None and after is not None and all(margins[j] - after[j] > 0 for j in c):
            flat = all(c[j] <= SWEEP_FLAT * (last_ok or c0).get(j, 0.0) for j in c)
            spent, prev, consts, last_ok = after, rho, c, c
            best = max(best, prev)
            # as wide as the last piece or SWEEP_RATIO - 1 of the radius reached; where the
            # constants grew by less than SWEEP_FLAT over the piece, SWEEP_REACH of the width
            # the margins left allow at them (near a decision boundary the constants are
            # flat: a few pieces instead of a crawl from a small start, 17 -> 5 runs)
            reach = min((margins[j] - spent[j]) / c[j] for j in c)
            width = max(width, prev * (SWEEP_RATIO - 1), SWEEP_REACH * reach if flat else 0.0)
        else:
            if c is not None:  # the partial piece: X at distance prev + delta, delta < width
                delta = min((margins[j] - spent[j]) / c[j] for j in c)
                part = prev + max(0.0, min(delta, width)) * (1 - 1e-9)
                if part > best:
                    best, consts = part, c
                fail = (rho, c)
            width *= SWEEP_SHRINK
        if fail is not None and last_ok and fail[0] > prev:
            # a failed ball lies beyond: the next width from the constants interpolated
            # between the last certified ball and it (a choice of the next radius only)
            guess = _predicted_width(prev, last_ok, fail, margins, spent)
            if guess is not None:
                width = guess
        if walked:  # one progress report per engine run
            _tick(progress, runs, steps, max(best, floor))
        if best >= cap * (1 - SWEEP_CAP_TOL):
            break  # the attack's radius: the true radius is no larger
        if last_ok and floor > 0 and \
                prev + min((margins[j] - spent[j]) / last_ok[j] for j in last_ok) <= floor:
            # the margins left carry the sweep at most this far at the constants of the last
            # certified ball, and the constants grow with the radius: it will not pass the
            # other route's radius (a cutoff for time only: either radius is sound)
            _stopped(progress, max(best, floor), cut)
            break
    return best, runs, consts


# the sweep's next width after a failed ball: this fraction of the width the interpolated
# constants would just allow (below 1: the walk there should certify)
SWEEP_PREDICT = 0.9


def _predicted_width(prev: float, last_ok: dict[int, float],
                     fail: tuple[float, dict[int, float]], margins: dict[int, float],
                     spent: dict[int, float]) -> float | None:
    """The width w with w L_j(prev + w) = m_j - S_j for the tightest j, L_j interpolated
    log-linearly between the last certified ball (prev) and the failed one (a guess of the
    next piece: where the constants grow faster than exponentially the chord lies above
    them, so the piece tends to certify), times SWEEP_PREDICT; None where it is not
    positive."""
    rho_f, c_f = fail
    span = rho_f - prev
    if span <= 0:
        return None

    def fits(w: float) -> bool:
        t = w / span
        return all(w * math.exp((1 - t) * math.log(last_ok[j]) + t * math.log(c_f[j]))
                   < margins[j] - spent[j] for j in last_ok if j in c_f)
    if not all(last_ok[j] > 0 and c_f.get(j, 0) > 0 for j in last_ok) or not fits(0.0):
        return None
    lo, hi = 0.0, span
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * SWEEP_PREDICT if lo > 0 else None


def _stopped(progress: Callable[[str, float], None] | None, certified: float,
             cut: list[bool] | None = None) -> None:
    if cut is not None:
        cut.append(True)
    if progress is not None:
        progress(f"radius sweep stopped: it cannot pass the affine radius, certified "
                 f"{certified:.3g}", 1.0)
