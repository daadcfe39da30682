"""Certified robustness radii: certified <= true <= attack; the CLI's JSON and exit codes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bench.local_models import build, center, export, relu_mlp
from lsa_models.empirical.local import _pgd, _targets, attack_radius
from lsa_models.engine.drivers.jacobian import local_jacobian
from lsa_models.engine.remainders import telescope
from lsa_models.engine.routes import radius_search, sweep
from lsa_models.engine.routes import table as routes
from lsa_models.engine.routes.certify import robustness
from lsa_models.onnx import OnnxModel, load_onnx
from service.cli import app
from tests.margins import boundary_point


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(build("mlp", seed=4), tmp_path_factory.mktemp("rob") / "mlp.onnx")


def _no_flip_inside(f: torch.nn.Module, x0: np.ndarray, label: int, radius: float, norm: str,
                    rng: np.random.Generator) -> None:
    """No point of the certified ball (50 corners or sphere points) flips the label."""
    for _ in range(50):
        d = boundary_point(rng, x0.shape, radius, norm)
        with torch.no_grad():
            assert int(f(torch.from_numpy(x0 + d)).argmax()) == label


def test_robustness_certified_radius_holds_and_is_below_attack(mlp_path: Path) -> None:
    om: OnnxModel = load_onnx(mlp_path.read_bytes())
    x0 = center(5).numpy().astype(np.float64)
    f = om.module.with_dtype(torch.float64)
    label = int(f(torch.from_numpy(x0)).argmax())
    for norm in ("2", "inf"):
        r = robustness(om, x0, label, norm)
        assert r.predicted == label and r.certified_radius > 0
        assert r.attack_radius is not None and r.certified_radius <= r.attack_radius
        _no_flip_inside(f, x0, label, r.certified_radius, norm, np.random.default_rng(0))


def test_robustness_cli_json_and_bad_label(mlp_path: Path, tmp_path: Path) -> None:
    x0 = tmp_path / "x0.npy"
    np.save(x0, center(5).numpy())
    runner = CliRunner()
    res = runner.invoke(app, ["robustness", str(mlp_path), "--at", str(x0), "--label", "0",
                              "--norm", "inf", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["norm"] == "inf" and out["certified_radius"] >= 0
    assert out["certified_by"] in ("affine", "sweep") and out["affine_walks"] >= 0
    assert out["affine_radius"] <= out["certified_radius"]
    assert set(out["margins"]) == {"1", "2", "3"}
    bad = runner.invoke(app, ["robustness", str(mlp_path), "--at", str(x0), "--label", "7"])
    assert bad.exit_code == 2 and "label must be in 0..3" in bad.stderr


@pytest.mark.parametrize("kind", ["mlp", "tf1"])
def test_robustness_pgd_finds_no_flip_inside_the_certified_ball(
        kind: str, tmp_path: Path) -> None:
    """PGD (margin losses, one per runner-up class, restarts) at the certified radius never
    flips the label (a short sweep: any certified radius must hold, the best one is measured
    in bench/)."""
    om = load_onnx(export(build(kind, seed=6), tmp_path / f"{kind}.onnx").read_bytes())
    x0 = center(8).numpy().astype(np.float64)
    f = om.module.with_dtype(torch.float64)
    label = int(f(torch.from_numpy(x0)).argmax())
    for norm in ("2", "inf"):
        r = robustness(om, x0, label, norm, steps=10, attack_restarts=1)
        assert r.certified_radius > 0 and r.sweep_runs >= 2
        assert r.attack_radius is None or r.certified_radius <= r.attack_radius
        gen = torch.Generator().manual_seed(0)
        c = torch.from_numpy(x0)
        hit = _pgd(f, c, label, r.certified_radius, norm, 4, 60, gen, _targets(f, c, label))
        assert hit is None


def test_attack_radius_follows_a_class_the_untargeted_loss_cannot_see() -> None:
    """Class 1 is nearest at the centre but cannot move (its logit is constant), class 2
    flips the label once x_0 > 0.1: the untargeted max-margin loss has a zero gradient at
    the centre (its max is class 1's), the targeted run finds the flip at the true radius."""
    def f(x: torch.Tensor) -> torch.Tensor:
        x0 = x.reshape(-1)[0]
        return torch.stack([torch.ones_like(x0), 0.9 * torch.ones_like(x0), 10.0 * x0])
    c = torch.zeros(1, 3, 2, dtype=torch.float64)
    assert _targets(f, c, 0) == [1, 2]
    gen = torch.Generator().manual_seed(0)
    assert _pgd(f, c, 0, 0.105, "inf", 1, 40, gen) is None  # the untargeted loss alone
    for norm in ("inf", "2"):
        r = attack_radius(f, c.numpy(), 0, norm, restarts=1)
        assert r is not None and 0.1 <= r <= 0.1 * 1.001


def test_robustness_takes_the_larger_route_and_names_it(tmp_path: Path) -> None:
    """On the 1-layer Transformer's inf-ball the affine route certifies past the sweep
    (0.0659 against the sweep's 0.029): the radius is the larger,
    `certified_by` names it, and the affine radius's margins are positive when recomputed on
    that ball."""
    from lsa_models.engine.drivers.margins import margin_lower_bounds
    from lsa_models.engine.routes.radius_search import QUAD_TOL
    om = load_onnx(export(build("tf1"), tmp_path / "tf1.onnx").read_bytes())
    x0 = center().numpy().astype(np.float64)
    f = om.module.with_dtype(torch.float64)
    label = int(f(torch.from_numpy(x0)).argmax())
    r = robustness(om, x0, label, "inf", steps=8, attack_restarts=1)
    assert r.certified_by == "affine" and r.affine_walks > 1
    assert r.certified_radius == r.affine_radius > 0 and r.pair_constants == {}
    # its last search has the second-order symbols (attention on the inf-ball)
    low = margin_lower_bounds(om, x0, r.affine_radius, "inf", label, quad=True)
    assert low is not None and min(low.values()) > 0
    # the largest to QUAD_TOL (regula falsi): just past it a margin is spent
    past = margin_lower_bounds(om, x0, r.affine_radius * (1 + 1.01 * QUAD_TOL), "inf", label,
                               quad=True)
    assert past is not None and min(past.values()) <= 0
    # from a quarter of the first-order radius, then from just past the plain radius: fewer
    # walks than bisection's 15 each
    assert r.affine_walks <= 16
    assert r.attack_radius is None or r.certified_radius <= r.attack_radius
    stages: list[tuple[str, float]] = []
    robustness(om, x0, label, "inf", steps=3, attack_restarts=1,
               progress=lambda s, p: stages.append((s, p)))
    fractions = [p for _, p in stages]
    assert fractions == sorted(fractions) and stages[0][0].startswith("attack:")
    assert stages[1][0].startswith("affine radius: tried")
    # the sweep probes the affine radius first and stops: it cannot pass it (time only; the
    # adjoint graph's second sweep runs only where this one was not cut off)
    assert stages[-1][0].startswith("radius sweep stopped: it cannot pass the affine radius")
    assert stages[-1][1] == 1.0


def test_sweep_stops_once_it_cannot_pass_the_other_routes_radius(mlp_path: Path) -> None:
    """sweep._sweep with `floor` (the affine route's radius) first probes 0.75 floor and
    stops when (1 - 0.75) floor L_j there already spends a margin (it cannot pass the floor),
    and stops later once the margins left, at the last certified ball's constants, cannot
    carry it past the floor: a floor beyond any reach stops it at the probe; a floor below
    every piece only costs the probe's run."""
    from lsa_models.engine.routes.sweep import _sweep
    om = load_onnx(mlp_path.read_bytes())
    x0 = center(5).numpy().astype(np.float64)
    logits = om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).reshape(-1).detach()
    label = int(logits.argmax())
    margins = {j: float(logits[label] - logits[j]) - 1e-6 for j in range(logits.numel())
               if j != label}
    full, runs_full, _ = _sweep(om, x0, "inf", label, margins, 30)
    # a floor past the first-order radius: the probe at 0.75 of it spends a margin at once
    flags: list[bool] = []
    cut, runs_cut, _ = _sweep(om, x0, "inf", label, margins, 30, floor=10.0, cut=flags)
    assert (cut, runs_cut) == (0.0, 2) and runs_full > 2 and flags == [True]
    # a floor below every piece: the probe costs one run, the radius is the same
    flags = []
    same, runs_same, _ = _sweep(om, x0, "inf", label, margins, 30, floor=1e-9, cut=flags)
    assert (same, runs_same) == (full, runs_full + 1) and flags == []


def test_robustness_skips_the_adjoint_sweep_after_a_cut_off_one(
        mlp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a graph with attention the inf-ball's enclosure sweep runs first and the adjoint
    graph's sweep after it, unless the first one stopped because it cannot pass the affine
    radius (x-transformers' 4 sublayers: ~50 s per enclosure run, and the second sweep, which
    also stops there, doubled the job)."""
    om = load_onnx(mlp_path.read_bytes())
    x0 = center(5).numpy().astype(np.float64)
    label = int(om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).argmax())
    monkeypatch.setattr(routes, "has_attention", lambda om: True)
    monkeypatch.setattr(routes, "use_quad", lambda om, x: False)
    monkeypatch.setattr(radius_search, "affine_radius", lambda *a, **k: (0.02, 3))
    for stop, calls in ((True, 1), (False, 2)):
        seen: list[float] = []

        def fake(*a: object, cut: list[bool] | None = None, stop: bool = stop,
                 seen: list[float] = seen, **k: object) -> tuple[float, int, dict]:
            seen.append(1.0)
            if cut is not None and stop:
                cut.append(True)
            return 0.01, 3, {}
        monkeypatch.setattr(routes, "SWEEP_PASSES",
                            tuple(replace(r, run=fake) for r in routes.SWEEP_PASSES))
        r = robustness(om, x0, label, "inf")
        assert len(seen) == calls and r.certified_radius == 0.02 and r.certified_by == "affine"


def test_sweep_near_a_decision_boundary_takes_few_pieces_and_stops_at_the_attack(
        mlp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small margins (a centre near the boundary): the constants barely grow over the radii
    swept, so after a piece whose constants grew by less than SWEEP_FLAT the next is half of
    what the margins left allow (a causal-mask classifier's job: 17 runs -> 5); the radius
    stays within 2% of the crawl's, and with `cap` (the attack's radius) the sweep stops
    there."""
    om = load_onnx(mlp_path.read_bytes())
    x0 = center(5).numpy().astype(np.float64)
    logits = om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).reshape(-1).detach()
    label = int(logits.argmax())
    margins = {j: 1e-3 * float(logits[label] - logits[j]) for j in range(logits.numel())
               if j != label}
    fast, runs_fast, _ = sweep._sweep(om, x0, "inf", label, margins, 30, adjoint=False)
    monkeypatch.setattr(sweep, "SWEEP_FLAT", 0.0)  # never flat: the crawl
    slow, runs_slow, _ = sweep._sweep(om, x0, "inf", label, margins, 30, adjoint=False)
    assert runs_fast < runs_slow and fast >= 0.98 * slow
    capped, runs_capped, _ = sweep._sweep(om, x0, "inf", label, margins, 30, adjoint=False,
                                          cap=0.5 * slow)
    assert 0.5 * slow * (1 - 1e-3) <= capped < slow and runs_capped < runs_slow


def test_robustness_relu_mlp_by_the_affine_route(tmp_path: Path) -> None:
    """A ReLU MLP (the commonest model there is): the affine forms take Relu (DeepZ's chord,
    affine_rules.RELU), so the affine route certifies it (before: no radius at all), and the
    adjoint graph's ReluGrad lifts the inf sweep above it (measured: inf 0.93x the attack
    radius by the sweep, 2-norm 0.89x by the affine route; before, the enclosure's sweep
    alone: 0.75x); no point of the certified ball flips the label."""
    om = load_onnx(export(relu_mlp(), tmp_path / "relu.onnx").read_bytes())
    x0 = center(1).numpy().astype(np.float64)
    f = om.module.with_dtype(torch.float64)
    label = int(f(torch.from_numpy(x0)).argmax())
    rng = np.random.default_rng(0)
    for norm in ("inf", "2"):
        r = robustness(om, x0, label, norm)
        assert r.affine_radius > 0 and r.attack_radius is not None
        assert 0.85 * r.attack_radius <= r.certified_radius <= r.attack_radius
        _no_flip_inside(f, x0, label, r.certified_radius, norm, rng)


@pytest.fixture(scope="module")
def tf1(tmp_path_factory: pytest.TempPathFactory) -> OnnxModel:
    return load_onnx(export(build("tf1", seed=5), tmp_path_factory.mktemp("tf1") / "tf1.onnx")
                     .read_bytes())


@pytest.mark.parametrize(("norm", "eps"), [("2", 0.1), ("inf", 1e-2)])
def test_sweep_enclosure_keeps_the_rows_and_margins_of_the_plain_call(
        tf1: OnnxModel, norm: str, eps: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sweep asks of the enclosure (whole=False: no whole-output bounds; the
    remainder terms computed once per adjoint, `Telescope.plain`) changes no row and no
    margin bound: the same numbers as the plain call, and as with every term recomputed."""
    x0 = center(1).numpy().astype(np.float64)
    label = int(tf1.module.with_dtype(torch.float64)(torch.from_numpy(x0)).argmax())
    plain = local_jacobian(tf1, x0, eps, norm, margins_of=label)
    sweep = local_jacobian(tf1, x0, eps, norm, margins_of=label, whole=False)
    monkeypatch.setattr(telescope.Telescope, "plain", lambda self, u, ga: u.term(ga))
    fresh = local_jacobian(tf1, x0, eps, norm, margins_of=label)
    assert sweep.structured is None and sweep.opnorm_two is None
    assert plain.structured is not None
    for other in (sweep, fresh):
        assert np.array_equal(other.jr, plain.jr) and other.margin_dual == plain.margin_dual
        assert all(np.array_equal(other.margin_jr[j], plain.margin_jr[j])
                   for j in plain.margin_jr)
    assert fresh.upper() == plain.upper()


def test_two_ball_sweep_constants_without_halvings_hold_at_ball_points(tf1: OnnxModel) -> None:
    """The 2-ball sweep's margin constants (without the half-ball walk) bound the exact
    float64 margin gradients at boundary points of the ball and along projected ascent of
    their norms."""
    x0 = center(1).numpy().astype(np.float64)
    f = tf1.module.with_dtype(torch.float64)
    label = int(f(torch.from_numpy(x0)).argmax())
    r = 0.2
    consts = sweep._constants_at(tf1, x0, r, "2", label, adjoint=False)
    assert consts is not None
    rng = np.random.default_rng(0)

    def grads(d: torch.Tensor) -> dict[int, torch.Tensor]:
        out = f(torch.from_numpy(x0) + d).reshape(-1)
        return {j: torch.autograd.grad(out[label] - out[j], d, retain_graph=True,
                                       create_graph=True)[0] for j in consts}
    worst = dict.fromkeys(consts, 0.0)
    for _ in range(6):
        d = torch.from_numpy(boundary_point(rng, x0.shape, r, "2")).requires_grad_(True)
        for _step in range(8):  # ascent of the first margin's gradient norm
            g = grads(d)
            for j, gj in g.items():
                worst[j] = max(worst[j], float(gj.norm()))
            (h,) = torch.autograd.grad(g[next(iter(consts))].norm(), d)
            with torch.no_grad():
                d = d + 0.1 * r * h / h.norm().clamp_min(1e-300)
                d = (d * min(1.0, r / float(d.norm()))).requires_grad_(True)
    assert all(worst[j] <= consts[j] for j in consts)
    assert max(worst[j] / consts[j] for j in consts) > 0.2  # the points reach the ball's size


@pytest.mark.parametrize("steep", [5.0, 20.0, 60.0])
def test_regula_falsi_reaches_a_cliff_root_without_creeping(steep: float) -> None:
    """The radius search's bracket on a lower bound that falls ever faster past its root (as
    the margins' lower bounds do: tf2's 2-ball is -1e2 at 4x its radius): the returned end
    certifies (value > 0), lies within the tolerance of the root, and the geometric step
    keeps the walks few where Illinois' halvings alone took one walk per 5% of the bracket
    (the secant from the certified side sticks at the low clamp)."""
    root = 0.2

    def value(r: float) -> float:
        calls.append(r)
        return 1.0 - float(np.exp(steep * (r / root - 1.0)))

    calls: list[float] = []
    lo, hi = root / 4, root * 4
    flo, fhi = value(lo), value(hi)
    calls.clear()
    got = radius_search._regula_falsi(value, lo, flo, hi, fhi, lambda: len(calls) < 60, tol=1e-3)
    walks = len(calls)
    assert value(got) > 0
    assert root * (1 - 1e-3) <= got < root
    # Illinois alone: 10 / 12 / 16 walks for steep 5 / 20 / 60
    assert walks <= {5.0: 10, 20.0: 12, 60.0: 14}[steep], calls
