"""The public local functions: `certify_local` (the Lipschitz constant on a ball around one
input) and `robustness` (certified and attack radii for one label).

Both take a loaded model: an ONNX graph (`OnnxModel`, or a `LoadedModel` from
`lsa_models.analysis.load_model_bytes`); a native model is exported to ONNX first (the same
lowering the service uses for downloads), so one engine bounds both.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..bounds.layer_graph.ball import BallNotCertified
from ..bounds.numerics import mul_up, sqrt_up
from ..bounds.report import BoundResult, LayerBound, NormName
from ..empirical.local import attack_radius
from ..onnx.analyzer import analyse
from ..onnx.ball import ball_bound
from ..onnx.export import export_onnx
from ..onnx.loading import OnnxModel, load_onnx
from .adjoint import AdjointGraph
from .affine import MAX_FORM_ENTRIES, NotAffine, quad_size
from .budget import Budget
from .driver import (
    Centre,
    LocalJacobian,
    center_sha256,
    check_center,
    local_jacobian,
    margin_lower_bounds,
)
from .tangent import NoTangent, TangentGraph
from .values import LocalNotCertified

METHOD = ("local: Jacobian enclosure over the ball {X : ||X - X0|| <= eps}, op by op "
          "(docs/local-bounds.md): centre Jacobian exact in float64, remainder by "
          "telescoping over the ops; the best of it, the per-layer local rules on the layer "
          "graph (2-norm) and the global bound; upward rounding")


def as_onnx(model: Any, seq_len: int | None = None) -> OnnxModel:
    """The ONNX graph of a loaded model (native models are exported at `seq_len`)."""
    if isinstance(model, OnnxModel):
        return model
    onnx_model = getattr(model, "onnx", None)
    if isinstance(onnx_model, OnnxModel):
        return onnx_model
    module = getattr(model, "module", model)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"cannot bound a {type(model).__name__} locally")

    n = seq_len or getattr(model, "seq_len", None) or getattr(module, "default_seq_len", None)
    if n is None:
        raise ValueError("the sequence length of the input is unknown")
    with tempfile.TemporaryDirectory() as tmp:
        path = export_onnx(module, Path(tmp) / "model.onnx", int(n), dynamo=False)
        return load_onnx(path.read_bytes(), "model.onnx")


def _domain(x0: np.ndarray, eps: float, norm: str) -> dict[str, Any]:
    return {"kind": "ball", "norm": norm, "eps": eps, "center_sha256": center_sha256(x0)}


def _global(model: OnnxModel, norm: NormName, x: np.ndarray, eps: float) -> BoundResult:
    """The global analysis on the tokens the ball can reach: each token's 2-norm is at most
    ||x0_i|| + eps (2-ball) or ||x0_i|| + eps sqrt(D) (inf-ball)."""

    d = x.shape[-1]
    rows = np.sqrt(np.square(x.reshape(-1, d)).sum(axis=1))  # (N,)
    reach = eps if norm == "2" else mul_up(eps, sqrt_up(d))
    radius = float(np.nextafter(float(rows.max()) * (1 + 1e-15), np.inf)) + reach
    return analyse(model, norm, model.spec.seq_len, radius * (1 + 1e-12))


def _ball_candidate(om: OnnxModel, x: np.ndarray, eps: float, norm: str,
                    layers: list[LayerBound]) -> float | None:
    """Per-layer local rules on the layer graph (2-norm; lsa_models/onnx/ball.py); a layer
    factor smaller than the global one replaces it in the report."""
    if norm != "2":
        return None
    try:
        upper, ball_layers = ball_bound(om, x, eps)
    except BallNotCertified:
        return None
    by_name = {lb.name: lb for lb in layers}
    for b in ball_layers:
        g = by_name.get(b.name)
        if g is not None and b.upper is not None and g.upper is not None and b.upper < g.upper:
            g.global_upper = g.upper if g.global_upper is None else g.global_upper
            g.upper, g.rule = b.upper, b.rule
    return upper


TANGENT_METHOD = ("smallest here: the tangent graph's affine forms over the ball and the "
                  "direction box (docs/local-graphs.md, 'The inf-ball by the tangent graph')")


# the tangent graph is tried where the best bound exceeds the centre's norm by this factor, on
# inputs of at most TANGENT_MAX_INPUT entries (its forms carry 2 P columns and more)
TANGENT_GAIN, TANGENT_MAX_INPUT = 1.02, 4096


def _tangent_candidate(om: OnnxModel, x: np.ndarray, eps: float, norm: str) -> float | None:
    """inf-ball: max_i sup ||row i of J(X)||_1 from the tangent graph (tangent.py); None where
    a node has no tangent rule or the forms do not reach the output."""
    if norm != "inf" or eps <= 0 or x.size > TANGENT_MAX_INPUT:
        return None
    try:
        # with second-order symbols where the graph has attention (its forms 1.4x the time,
        # 2x tighter on larger balls: products of two input-dependent tensors keep their
        # quadratic parts)
        rows = TangentGraph(om, x).bound(eps, quad=_use_quad(om, x))
    except (NoTangent, NotAffine, FloatingPointError, ValueError, LocalNotCertified,
            RuntimeError, KeyError, IndexError, TypeError):
        # an optional candidate: a graph it cannot take keeps the other bounds
        return None
    return None if rows is None else float(rows.max())


def _has_attention(om: OnnxModel) -> bool:
    """Whether the graph has a Softmax (attention)."""
    return any(nd.op_type == "Softmax" for nd in om.module.runtime_nodes)  # type: ignore[union-attr]


def _use_quad(om: OnnxModel, x: np.ndarray) -> bool:
    """Whether the walks get second-order symbols (affine.QUAD): graphs with attention
    (products of two input-dependent tensors, where they pay), while the widest tensor's form
    with their P(P+1)/2 columns fits half the form budget (an 8-token, D = 16 Transformer:
    512 x 8384 entries; HF GPT-2 at P = 256 does not fit and keeps the plain walks)."""
    if not _has_attention(om):
        return False
    module = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x))
    widest = max(int(t.numel()) for t in env.values() if isinstance(t, torch.Tensor))
    return widest * (x.size + quad_size(x.size)) <= MAX_FORM_ENTRIES // 2


ADJOINT_METHOD = ("smallest here: the adjoint graph's affine forms over the ball, one per "
                  "output row (docs/local-graphs.md, 'Margin gradients by the adjoint graph')")
# the adjoint graph walks once per output entry: on outputs of at most this many entries
ADJOINT_MAX_ROWS = 32


def _output_size(om: OnnxModel, x: np.ndarray) -> int:
    """The number of output entries at x (the adjoint graphs' weight vectors' size)."""
    with torch.no_grad():
        return int(om.module.with_dtype(torch.float64)(torch.from_numpy(x)).numel())


def _adjoint_candidate(om: OnnxModel, x: np.ndarray, eps: float, norm: str) -> float | None:
    """inf-ball: max_i sup ||J(X)^T e_i||_1 over the ball from the adjoint graph of every
    output entry i (adjoint.py); None where a node has no adjoint rule, the output is larger
    than ADJOINT_MAX_ROWS entries, or a walk does not reach the input."""
    if norm != "inf" or eps <= 0 or x.size > TANGENT_MAX_INPUT:
        return None
    try:
        k = _output_size(om, x)
        if k > ADJOINT_MAX_ROWS:
            return None
        rows = _adjoint_bounds({i: AdjointGraph(om, x, np.eye(k)[i]) for i in range(k)},
                               eps, norm)
        if rows is None:
            return None
        best = max(rows.values())
    except (NoTangent, NotAffine, FloatingPointError, ValueError, LocalNotCertified,
            RuntimeError, KeyError, IndexError, TypeError):
        # an optional candidate: a graph it cannot take keeps the other bounds
        return None
    return best


def _graph_candidates(om: OnnxModel, x: np.ndarray, eps: float, norm: str,
                      engine: LocalJacobian | None, candidates: list[float]) -> str:
    """Adds the adjoint graph's bound, then the tangent graph's, to `candidates`, each only
    where the best bound so far leaves more than TANGENT_GAIN over the centre's own norm
    (neither is ever below it; each costs about one engine run); the method string names the
    one that gave the smallest. Neither dominates: the adjoint graph's products compound with
    depth, the tangent graph's pair symbols are looser on one block."""
    def loose() -> bool:
        return engine is None or bool(candidates) and \
            min(candidates) > TANGENT_GAIN * engine.center_norm()
    method = METHOD
    for graph, how in ((_adjoint_candidate, ADJOINT_METHOD), (_tangent_candidate,
                                                              TANGENT_METHOD)):
        if not loose():
            break
        v = graph(om, x, eps, norm)
        if v is not None:
            if not candidates or v < min(candidates):
                method = METHOD + "; " + how
            candidates.append(v)
    return method


def certify_local(model: Any, at: np.ndarray, eps: float, norm: NormName) -> BoundResult:
    """Certified upper bound on sup ||J_F(X)||_norm over {X : ||X - at||_norm <= eps}
    (2: Frobenius of the whole input; inf: largest entry). `at` is one input (N, D) or
    (1, N, D). Returns a `BoundResult` whose `domain` describes the ball, `upper` the local
    constant (the best of the Jacobian enclosure and the global per-layer bound on the
    tokens the ball reaches), and per-layer factors with the rule that produced them.
    Raises ValueError for a bad input shape or eps."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    om = as_onnx(model, np.asarray(at).shape[-2] if np.asarray(at).ndim >= 2 else None)
    x = check_center(om, at)
    glob = _global(om, norm, x, eps)
    layers = list(glob.layers)
    for lb in layers:
        lb.rule = lb.rule or f"global {lb.kind} rule on the tokens the ball reaches"
    engine: LocalJacobian | None = None
    reason = None
    try:
        # the value forms with second-order symbols where the graph has attention (2.5x the
        # time of a run, 10-25% tighter on larger balls)
        engine = local_jacobian(om, x, eps, norm, quad=_use_quad(om, x))
    except LocalNotCertified as exc:
        reason = f"local engine: {exc}"
    candidates = [] if glob.upper is None else [glob.upper]
    if engine is not None:
        candidates.append(engine.upper())
        by_name = {lb.name: lb for lb in layers}
        for name, kind, factor, rule in engine.layers:
            g = by_name.get(name)
            if g is not None:
                g.global_upper, g.upper, g.rule = g.upper, factor, rule
            else:
                layers.append(LayerBound(name, kind, factor, nodes=[name], rule=rule))
    ball = _ball_candidate(om, x, eps, norm, layers)
    if ball is not None:
        candidates.append(ball)
    method = _graph_candidates(om, x, eps, norm, engine, candidates)
    n = om.spec.seq_len or x.shape[-2]
    domain = _domain(x, eps, norm)
    if not candidates:
        return BoundResult(norm=norm, seq_len=n, radius=None, verdict="not_certified",
                           upper=None, layers=layers, method=method,
                           reason="; ".join(r for r in (reason, glob.reason) if r),
                           domain=domain)
    return BoundResult(norm=norm, seq_len=n, radius=None, verdict="certified",
                       upper=min(candidates), layers=layers, method=method, domain=domain)


# ---- robustness -----------------------------------------------------------------------------


@dataclass
class RobustnessResult:
    """certified_radius <= the true robustness radius <= attack_radius (when one is found)."""

    norm: str
    label: int
    predicted: int
    certified_radius: float
    attack_radius: float | None
    margins: dict[int, float]  # f_label - f_j at the centre
    center_sha256: str
    certify_seconds: float
    attack_seconds: float
    sweep_runs: int  # engine runs of the radius sweep
    pair_constants: dict[int, float] = field(default_factory=dict)  # at certified_radius
    # which route certified the radius: "sweep" (margin constants integrated along the
    # segment) or "affine" (margin lower bounds from the affine forms, affine.py)
    certified_by: str = "sweep"
    affine_radius: float = 0.0  # the affine route's radius (walks: affine_walks)
    affine_walks: int = 0
    # the search's time budget (seconds; None: none) and whether it stopped the search (the
    # radius is then the largest certified before it ran out: sound, maybe not the
    # largest); `stopped_before` names the stage it kept from running
    time_budget: float | None = None
    stopped_by_budget: bool = False
    stopped_before: str | None = None


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
        except LocalNotCertified:
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


# the margins' gradients also through the adjoint graph (adjoint.py), the smaller standing:
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
    return _adjoint_bounds(graphs, r, norm) if graphs else None


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
        k = _output_size(om, x)
        for j in range(k):
            if j != label:
                c = np.zeros(k)
                c[label], c[j] = 1.0, -1.0
                built[j] = AdjointGraph(om, x, c)
    except (NoTangent, NotAffine, ValueError, RuntimeError, KeyError, IndexError, TypeError):
        built = {}  # an optional refinement: the enclosure's constants stand
    with _ADJ_LOCK:
        _ADJ_CACHE.clear()
        _ADJ_CACHE[key] = (om, built)
    return built


def _adjoint_bounds(graphs: dict[int, AdjointGraph], r: float, norm: str
                    ) -> dict[int, float] | None:
    """Every graph's dual-norm bound on the ball, the forward graph's forms walked once."""
    out: dict[int, float] = {}
    try:
        primal = next(iter(graphs.values())).primal_forms(r, norm)
        for j, g in graphs.items():
            v = g.dual_norm_bound(r, norm, primal)
            if v is None:
                return None
            out[j] = v
    except (NotAffine, FloatingPointError, ValueError):
        return None
    return out


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


# the affine route: the radius grows by AFFINE_GROWTH while certified, then bisection to a
# relative width of AFFINE_TOL; at most AFFINE_WALKS walks
AFFINE_GROWTH, AFFINE_TOL, AFFINE_WALKS = 2.0, 1e-3, 48


AFFINE_SHARE = 0.2  # of a radius job's progress: the affine walks are cheap


def _scaled_progress(progress: Callable[[str, float], None] | None, lo: float, hi: float
                     ) -> Callable[[str, float], None] | None:
    if progress is None:
        return None
    p = progress
    return lambda stage, f: p(stage, lo + (hi - lo) * f)


def affine_radius(om: OnnxModel, x: np.ndarray, norm: str, label: int, start: float,
                  progress: Callable[[str, float], None] | None = None, quad: bool = False,
                  floor: float = 0.0, growth: float = AFFINE_GROWTH,
                  tol: float = AFFINE_TOL, eig: bool = False, budget: Budget | None = None
                  ) -> tuple[float, int]:
    """The largest radius (to a relative `tol`) whose margin lower bounds from the affine forms
    are all positive, searched from `start` > 0; (radius, walks). A radius r certifies the
    whole ball of radius r, so no integration is needed: this route and the sweep are
    independent, the larger one stands. The search brackets the radius (growing or shrinking
    `start` by AFFINE_GROWTH), then narrows the bracket by regula falsi on the smallest lower
    bound (Illinois' variant, each step kept inside the bracket's middle 90%; bisection where
    a walk failed): the bound is smooth in the radius, so this takes fewer walks than
    bisection. Only radii whose walk certified are reported. `quad`: the walks with
    second-order symbols (affine.QUAD); `eig`: those walks with the symbols' 2-ball sizes by
    eigenvalues (affine.QUAD_EIG); `floor`: a radius certified already (another walk's),
    the bracket's low end when `start` does not certify (no search below it); `budget`:
    looked at before each walk but the first, the largest radius certified so far returned
    once it is spent."""
    ctr = Centre(om, x)
    walks = 0
    b = budget or Budget()
    more_walks = "more affine walks"

    def value(r: float) -> float:
        """min_j of the margins' lower bounds on the ball of radius r (-inf: no bound)."""
        nonlocal walks
        walks += 1
        began = b.clock()
        try:
            low = margin_lower_bounds(om, x, r, norm, label, ctr, quad=quad, eig=eig)
        except (LocalNotCertified, FloatingPointError, ValueError):
            low = None
        b.lap(began)
        v = -math.inf if not low else min(low.values())
        if not math.isfinite(v):
            v = -math.inf
        if progress is not None:
            kind = ("second-order affine (eigenvalues)" if eig else "second-order affine") \
                if quad else "affine"
            progress(f"{kind} radius: tried {r:.3g}, {'certified' if v > 0 else 'not'}",
                     min(1.0, walks / AFFINE_WALKS))
        return v

    lo, flo, hi = 0.0, math.inf, start
    fhi = value(hi)
    while walks < AFFINE_WALKS and fhi > 0 and not b.out(more_walks, b.last):  # grow
        lo, flo, hi = hi, fhi, hi * growth
        fhi = value(hi)
    if fhi > 0:  # stopped while growing (the budget or the walks' cap): hi certified
        return hi, walks
    if lo == 0.0 and 0 < floor < hi:
        lo = floor  # certified by the caller's other walk: its bound is not known here
    if lo == 0.0:  # shrink until something certifies
        while walks < AFFINE_WALKS // 2 and not b.out(more_walks, b.last):
            r = hi / growth**2
            fr = value(r)
            if fr > 0:
                lo, flo = r, fr
                break
            hi, fhi = r, fr
        if lo == 0.0:
            return 0.0, walks
    return _regula_falsi(value, lo, flo, hi, fhi,
                         lambda: walks < AFFINE_WALKS and not b.out(more_walks, b.last), tol), \
        walks


def _regula_falsi(value: Callable[[float], float], lo: float, flo: float, hi: float,
                  fhi: float, more: Callable[[], bool], tol: float = AFFINE_TOL) -> float:
    """Narrows the bracket [lo, hi] (value(lo) = flo > 0 >= value(hi) = fhi) to a relative
    width `tol` by regula falsi (Illinois' variant: the end kept twice has its value
    halved; each step inside the bracket's middle 90%; bisection where a value is not
    finite) while `more()`; returns the certified end."""
    side = 0  # Illinois: which end was kept last (-1 lo, +1 hi)
    # (a bracket of exactly tol, as one growth step of the eigenvalue stage leaves it, EIG_GROWTH
    # = 1 + EIG_TOL, is narrow enough: without the slack its rounding decided whether one
    # more walk ran, and the same radius search ended 1.5% apart on two machines)
    while hi - lo > tol * lo * (1 + 1e-9) and more():
        width = hi - lo
        if math.isfinite(fhi) and math.isfinite(flo) and flo > fhi:
            r = hi - fhi * width / (fhi - flo)
            if side == -1 and r < lo + 0.05 * width:
                # the secant at the low clamp again after lo moved: the bound falls far
                # faster near hi than the line says (on a Transformer's 2-ball: -1e2 at 4x
                # the radius), and Illinois' halvings of fhi would take one walk each: the middle
                r = math.sqrt(lo * hi) if lo > 0 else lo + 0.5 * width
            r = min(max(r, lo + 0.05 * width), hi - 0.05 * width)
        else:
            r = lo + 0.5 * width
        fr = value(r)
        if fr > 0:
            lo, flo = r, fr
            if side == -1 and math.isfinite(fhi):
                fhi *= 0.5  # the far end kept twice: halve its value (Illinois)
            side = -1
        else:
            hi, fhi = r, fr
            if side == 1:
                flo *= 0.5
            side = 1
    return lo


AFFINE_START = 0.25  # of the first-order radius: where the affine search starts
# the affine route's second search, with second-order symbols (affine.QUAD), on these balls
# for graphs with attention (products of two input-dependent tensors): on the 2-ball their
# coefficients' l1 sum is far above the quadratic forms' eigenvalue bound the plain walk
# uses (a margin bound of -10 against +0.001 near the radius), and an MLP (no such products) gains
# nothing; it starts QUAD_GROWTH past the plain radius and steps by that factor
QUAD_NORMS: tuple[str, ...] = ("inf", "2")
QUAD_GROWTH = 1.15
# its growth steps past that start per norm: on the inf-ball the second-order radius is
# about 1.2x the plain one on Transformer classifiers, so steps of 1.08 leave a bracket half
# as wide as 1.15's (one or two second-order walks fewer); on the 2-ball it is about 1.28x and
# 1.08 takes more steps
QUAD_STEP: dict[str, float] = {"inf": 1.08, "2": QUAD_GROWTH}
# the searches' relative tolerances where the second-order one follows: the plain one only
# gives it a start, and each of its walks costs 4 plain ones (4 walks fewer, the radius 0.3%
# lower at most)
QUAD_PLAIN_TOL, QUAD_TOL = 1e-2, 1e-2
# the third search on these balls: the second-order walks with the symbols' sizes by the
# quadratic forms' eigenvalues (affine.QUAD_EIG, ~4x a second-order walk's time), from
# EIG_GROWTH past the second-order radius (5% more radius in two or three walks)
EIG_NORMS: tuple[str, ...] = ("2",)
EIG_GROWTH = 1.05
EIG_TOL = 5e-2
# a second-order walk's time over a plain one's, an eigenvalue walk's over a second-order
# one's (the comments above): a time budget's predictions of the next stage only
QUAD_WALK_COST, EIG_WALK_COST = 4.0, 3.5


def second_order(om: OnnxModel, x: np.ndarray, norm: str) -> bool:
    """Whether the affine route walks with second-order symbols after the plain walks: on
    QUAD_NORMS, for graphs where they pay and fit (`_use_quad`)."""
    return norm in QUAD_NORMS and _use_quad(om, x)


def affine_route(om: OnnxModel, x: np.ndarray, norm: str, label: int, start: float,
                 quad: bool, progress: Callable[[str, float], None] | None = None,
                 budget: Budget | None = None) -> tuple[float, int]:
    """The affine route's radius and walks: the plain search from `start`, then with `quad`
    the second-order one from just past it and, on EIG_NORMS, the eigenvalue one (each
    stage's walks only, through `margin_lower_bounds`; bench/radius_search_replay.py runs
    this on recorded margins). Its progress fills the first AFFINE_SHARE of a radius job.
    `budget`: looked at before each stage and between walks (the radius so far once it is
    spent)."""
    b = budget or Budget()
    if b.out("the affine walks"):
        return 0.0, 0
    aff, walks = affine_radius(om, x, norm, label, max(start, 1e-12),
                               _scaled_progress(progress, 0.0, AFFINE_SHARE),
                               tol=QUAD_PLAIN_TOL if quad else AFFINE_TOL, budget=b)
    if aff > 0 and quad and not b.out("the second-order affine walks",
                                      QUAD_WALK_COST * b.last):
        # then the walks with second-order symbols, from just past it (4x a plain walk's
        # time; about 15% more radius on attention models)
        eig = norm in EIG_NORMS
        mid = AFFINE_SHARE * (0.75 if eig else 1.0)
        aq, wq = affine_radius(om, x, norm, label, aff * QUAD_GROWTH,
                               _scaled_progress(progress, AFFINE_SHARE / 2, mid),
                               quad=True, floor=aff, growth=QUAD_STEP[norm], tol=QUAD_TOL,
                               budget=b)
        aff, walks = max(aff, aq), walks + wq
        if aff > 0 and eig and not b.out("the eigenvalue affine walks",
                                         EIG_WALK_COST * b.last):
            # and those with the 2-ball's sizes by eigenvalues (~3.5x a second-order walk;
            # about 5% more radius)
            ae, we = affine_radius(om, x, norm, label, aff * EIG_GROWTH,
                                   _scaled_progress(progress, mid, AFFINE_SHARE),
                                   quad=True, floor=aff, growth=EIG_GROWTH, tol=EIG_TOL,
                                   eig=True, budget=b)
            aff, walks = max(aff, ae), walks + we
    return aff, walks


def first_order_radius(f64: torch.nn.Module, x: np.ndarray, label: int,
                       margins: dict[int, float], norm: str) -> float:
    """min_j m_j / ||grad m_j(X0)||_dual, the gradients by autograd (inf where every
    gradient is 0)."""
    t = torch.from_numpy(x).requires_grad_(True)
    out = f64(t).reshape(-1)
    best = math.inf
    for j, m in margins.items():
        (g,) = torch.autograd.grad(out[label] - out[j], t, retain_graph=True)
        dual = float(g.abs().sum()) if norm == "inf" else float(g.norm())
        if dual > 0 and math.isfinite(dual):
            best = min(best, m / dual)
    return best


def _first_order_radius(f64: torch.nn.Module, x: np.ndarray, label: int,
                        margins: dict[int, float], norm: str) -> float:
    """`first_order_radius`, 1e-3 where it is not finite and positive (a starting guess
    only)."""
    best = first_order_radius(f64, x, label, margins, norm)
    return best if math.isfinite(best) and best > 0 else 1e-3


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
        cp = _constants_at(om, x, SWEEP_PROBE * floor, norm, label, replace(turns), adjoint)
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


def centre_margins(model: Any, at: np.ndarray, label: int, norm: str
                   ) -> tuple[OnnxModel, np.ndarray, torch.nn.Module, dict[int, float], int]:
    """(the graph, the checked centre X0, the float64 module, the margins f_label - f_j at X0
    less an allowance for the forward pass's rounding, the predicted class). ValueError for a
    bad norm, input or label."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    om = as_onnx(model, np.asarray(at).shape[-2] if np.asarray(at).ndim >= 2 else None)
    x = check_center(om, at)
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        logits = f64(torch.from_numpy(x)).reshape(-1).numpy()
    k = logits.size
    if not (0 <= label < k):
        raise ValueError(f"label must be in 0..{k - 1} (the model has {k} outputs), got "
                         f"{label}")
    scale = float(np.abs(logits).max())
    margins = {j: float(logits[label] - logits[j]) - 1e-9 * (1 + scale)
               for j in range(k) if j != label}
    return om, x, f64, margins, int(np.argmax(logits))


def robustness(model: Any, at: np.ndarray, label: int, norm: NormName,
               steps: int = 30, attack_restarts: int = 3, seed: int = 0,
               progress: Callable[[str, float], None] | None = None,
               time_budget: float | None = None) -> RobustnessResult:
    """Certified robustness radius of `label` at `at` (a sweep of radii with per-pair margin
    constants on each ball, integrated along the segment) and the smallest label-flipping
    perturbation PGD finds. `steps` caps the engine runs; `progress(stage, fraction)` is
    called once per engine run with the radius certified so far (it may raise to stop).
    `time_budget`: seconds from the call (monotonic clock; None: none), looked at between
    the stages, the affine walks and the sweep's runs (budget.py): once spent, the largest
    radius certified so far, with `stopped_by_budget`. ValueError for a bad input, label,
    norm or budget."""
    budget = Budget.start(time_budget)
    om, x, f64, margins, predicted = centre_margins(model, at, label, norm)
    # the attack first: the true radius is at most its radius, where the sweeps stop
    if progress is not None:
        progress("attack: searching for the smallest label flip (PGD)", 0.0)
    ta = time.monotonic()
    attack = attack_radius(f64, x, label, norm, restarts=attack_restarts, seed=seed)
    attack_s = time.monotonic() - ta
    cap = math.inf if attack is None else attack
    t0 = time.monotonic()
    lo, n_steps, consts = 0.0, 0, dict[int, float]()
    aff, walks = 0.0, 0
    if min(margins.values()) > 0:
        # the affine route first (cheap: no Jacobians), from a quarter of the first-order
        # radius min_j m_j / ||grad m_j(X0)||_dual (a guess: any start is sound)
        start = _first_order_radius(f64, x, label, margins, norm) * AFFINE_START
        aff, walks = affine_route(om, x, norm, label, start, second_order(om, x, norm),
                                  progress, budget)
        attention = _has_attention(om)
        # attention-free graphs (no Softmax: MLPs): one sweep, the adjoint graph's constants
        # in it from the start (cheap there: the MLP's inf job 4.0 s -> 1.3 s, radius 0.0714 ->
        # 0.0709); elsewhere the enclosure's sweep first (see below)
        one = norm in ADJOINT_NORMS and not attention
        cut: list[bool] = []
        if not budget.out("the radius sweep"):
            lo, n_steps, consts = _sweep(om, x, norm, label, margins, steps,
                                         _scaled_progress(progress, AFFINE_SHARE, 1.0), aff,
                                         adjoint=one, cap=cap, cut=cut, budget=budget)
        if 0 < lo < cap * (1 - SWEEP_CAP_TOL) and norm in ADJOINT_NORMS and not one \
                and not cut and not budget.out("the adjoint graph's sweep"):
            # the sweep again with the adjoint graph's constants too, where the enclosure's
            # sweep was not cut off by the affine radius (a choice of time: where the affine
            # route wins, the adjoint's sweep would walk 10 runs to stay below it; on an MLP
            # it adds about 1% of radius)
            lo2, n2, consts2 = _sweep(om, x, norm, label, margins, steps, None, max(aff, lo),
                                      cap=cap, budget=budget)
            n_steps += n2
            if lo2 > lo:
                lo, consts = lo2, consts2
    t1 = time.monotonic()
    by = "affine" if aff > lo else "sweep"
    return RobustnessResult(norm, label, predicted, max(lo, aff), attack, margins,
                            center_sha256(x), t1 - t0, attack_s, n_steps,
                            {} if by == "affine" else consts, by, aff, walks,
                            budget.seconds, budget.stopped, budget.stopped_before)
