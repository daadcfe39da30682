"""Verdicts at a given radius (lsa_models.engine.routes.at_radius): certified / attacked / unknown /
misclassified, consistent with the radius search and with attacks; the CLI's set mode, its
certified accuracy and its CI gate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from typer.testing import CliRunner

from bench.local_models import build, center, export, relu_mlp
from lsa_models.empirical.local import _pgd, _targets
from lsa_models.engine.routes import at_radius
from lsa_models.engine.routes.at_radius import decide, decide_all
from lsa_models.engine.routes.certify import robustness
from lsa_models.onnx import OnnxModel, load_onnx
from service.cli import app
from tests.margins import boundary_point
from tests.profile import at_most


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnnxModel, Path]:
    path = export(build("mlp", seed=4), tmp_path_factory.mktemp("atr") / "mlp.onnx")
    return load_onnx(path.read_bytes()), path


def _label(om: OnnxModel, x0: np.ndarray) -> int:
    with torch.no_grad():
        return int(om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).argmax())


def _holds(om: OnnxModel, x0: np.ndarray, label: int, radius: float, norm: str) -> None:
    """Nothing in the ball flips the label: 50 boundary points (corners, sphere points) and
    a stronger PGD than the verdict's (6 restarts x 80 steps per runner-up class)."""
    f = om.module.with_dtype(torch.float64)
    rng = np.random.default_rng(1)
    for _ in range(50):
        d = boundary_point(rng, x0.shape, radius, norm)
        with torch.no_grad():
            assert int(f(torch.from_numpy(x0 + d)).argmax()) == label
    c = torch.from_numpy(x0)
    gen = torch.Generator().manual_seed(3)
    assert _pgd(f, c, label, radius, norm, 6, 80, gen, _targets(f, c, label)) is None


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_decide_agrees_with_the_radius_search(mlp: tuple[OnnxModel, Path], norm: str) -> None:
    """Below the certified radius: certified (and nothing in the ball flips the label);
    past the attack radius: attacked, with a counterexample inside the ball whose largest
    output is another class; a certified verdict never comes with a radius PGD flips."""
    om, _ = mlp
    x0 = center(5).numpy().astype(np.float64)
    label = _label(om, x0)
    r = robustness(om, x0, label, norm)
    assert r.attack_radius is not None
    inside = decide(om, x0, label, norm, 0.9 * r.certified_radius)
    assert inside.status == "certified" and inside.certified_by is not None
    assert inside.predicted == label and inside.center_sha256 == r.center_sha256
    _holds(om, x0, label, 0.9 * r.certified_radius, norm)
    past = 1.05 * r.attack_radius
    out = decide(om, x0, label, norm, past)
    assert out.status == "attacked" and out.flip is not None and out.flip_class != label
    assert out.flip_distance is not None and out.flip_distance <= past
    d = out.flip - x0
    assert (np.abs(d).max() if norm == "inf" else np.linalg.norm(d)) <= past
    with torch.no_grad():
        y = om.module.with_dtype(torch.float64)(torch.from_numpy(out.flip)).reshape(-1)
    assert float(y[out.flip_class]) > float(y[label])


def test_decide_names_the_stage_that_certified(tmp_path: Path) -> None:
    """On an attention model the affine walks go plain -> second order (-> eigenvalues on the
    2-ball): a radius only the second-order walk certifies is certified by it, and the
    verdict holds against boundary points and PGD."""
    om = load_onnx(export(build("tf1", seed=0), tmp_path / "tf1.onnx").read_bytes())
    x0 = center(1).numpy().astype(np.float64)
    label = _label(om, x0)
    # issue-15's tf1: plain radius 0.0574, second order 0.0679 (docs/local-robustness.md)
    v = decide(om, x0, label, "inf", 0.0640)
    assert v.status == "certified" and v.certified_by == "affine (second order)"
    assert v.walks == 2 and v.margin_lower is not None and v.margin_lower > 0
    _holds(om, x0, label, 0.0640, "inf")


def test_decide_misclassified_and_bad_radius(mlp: tuple[OnnxModel, Path]) -> None:
    om, _ = mlp
    x0 = center(5).numpy().astype(np.float64)
    label = _label(om, x0)
    wrong = (label + 1) % 4
    v = decide(om, x0, wrong, "inf", 0.01)
    assert v.status == "misclassified" and v.predicted == label and v.walks == 0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="radius must be finite and > 0"):
            decide(om, x0, label, "inf", bad)
    with pytest.raises(ValueError, match="label must be in 0..3"):
        decide(om, x0, 9, "inf", 0.01)


def test_decide_unknown_when_neither_side_decides(mlp: tuple[OnnxModel, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the certified and the attack radius with an attack that finds nothing (no
    restarts at all): unknown, never certified past the true radius."""
    om, _ = mlp
    x0 = center(5).numpy().astype(np.float64)
    label = _label(om, x0)
    r = robustness(om, x0, label, "inf")
    assert r.attack_radius is not None
    mid = 0.5 * (r.certified_radius + r.attack_radius)
    monkeypatch.setattr(at_radius, "attack_at", lambda *a, **k: None)
    v = decide(om, x0, label, "inf", mid)
    assert v.status == "unknown" and v.flip is None and v.sweep_runs >= 1
    assert decide(om, x0, label, "inf", 1.05 * r.attack_radius).status == "unknown"


def test_decide_all_counts_and_accuracies(tmp_path: Path) -> None:
    """certified accuracy <= attack accuracy <= clean accuracy, counts add up, one verdict
    per input in order; labels that do not match the inputs are refused."""
    om = load_onnx(export(relu_mlp(), tmp_path / "relu.onnx").read_bytes())
    xs = np.stack([center(s).numpy().astype(np.float64) for s in range(1, 7)])
    f = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        pred = np.array([int(f(torch.from_numpy(x)).argmax()) for x in xs])
    labels = pred.copy()
    labels[0] = (pred[0] + 1) % 4  # one wrong label
    seen: list[int] = []
    rep = decide_all(om, xs, labels, "2", 0.05, progress=lambda i, n, v: seen.append(i))
    assert seen == list(range(6)) and len(rep.verdicts) == 6
    assert rep.verdicts[0].status == "misclassified"
    assert sum(rep.count(s) for s in at_radius.STATUSES) == 6
    assert rep.certified_accuracy <= rep.attack_accuracy <= rep.clean_accuracy == 5 / 6
    for v, x in zip(rep.verdicts, xs, strict=True):
        if v.status == "certified":
            _holds(om, x, v.label, 0.05, "2")
    with pytest.raises(ValueError, match="one integer per input"):
        decide_all(om, xs, labels[:3], "2", 0.05)
    # a bad input or label anywhere fails before any input is decided
    late = xs.copy()
    late[-1] = np.inf
    seen.clear()
    with pytest.raises(ValueError, match=r"inputs\[5\]: the input has non-finite"):
        decide_all(om, late, labels, "2", 0.05, progress=lambda i, n, v: seen.append(i))
    with pytest.raises(ValueError, match=r"labels\[5\]: label must be in 0..3"):
        decide_all(om, xs, np.array([*labels[:5], 4]), "2", 0.05,
                   progress=lambda i, n, v: seen.append(i))
    assert seen == []
    with pytest.raises(ValueError, match="labels must be integers"):
        decide_all(om, xs, labels.astype(np.float64), "2", 0.05)


def _same(a: at_radius.Verdict, b: at_radius.Verdict) -> bool:
    """Equal verdicts up to their wall-clock seconds (flips compared entry by entry)."""
    return replace(a, seconds=0.0) == replace(b, seconds=0.0) and (
        a.flip is None and b.flip is None
        or a.flip is not None and b.flip is not None and np.array_equal(a.flip, b.flip))


def test_robustness_cli_set_mode_gate_and_errors(mlp: tuple[OnnxModel, Path],
                                                 tmp_path: Path) -> None:
    """--inputs/--labels/--radius: the JSON's counts and accuracies; exit 1 below
    --min-certified-accuracy, 0 at or above it; exit 2 naming the option for bad input."""
    om, path = mlp
    xs = np.stack([center(s).numpy().astype(np.float32).reshape(8, 16) for s in (5, 6, 7)])
    labels = np.array([_label(om, x[None].astype(np.float64)) for x in xs])
    xi, yi = tmp_path / "xs.npy", tmp_path / "ys.npy"
    np.save(xi, xs)
    np.save(yi, labels)
    runner = CliRunner()
    base = ["robustness", str(path), "--inputs", str(xi), "--labels", str(yi), "--norm", "inf",
            "--radius", "0.02", "--json", "--time-budget", "none"]
    res = runner.invoke(app, base)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["n"] == 3 and sum(out["counts"].values()) == 3 and out["passed"] is None
    assert out["certified_accuracy"] <= out["attack_accuracy"] <= out["clean_accuracy"] == 1.0
    assert [s["label"] for s in out["samples"]] == labels.tolist()
    acc = out["certified_accuracy"]
    ok = runner.invoke(app, [*base, "--min-certified-accuracy", str(acc), "--workers", "2"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["passed"] is True
    assert [s["status"] for s in json.loads(ok.stdout)["samples"]] == [
        s["status"] for s in out["samples"]]
    if acc < 1:
        low = runner.invoke(app, [*base, "--min-certified-accuracy", "1"])
        assert low.exit_code == 1 and json.loads(low.stdout)["passed"] is False
    one = runner.invoke(app, ["robustness", str(path), "--at", str(tmp_path / "x0.npy"),
                              "--label", "0"])
    assert one.exit_code == 2 and "no such file" in one.stderr
    np.save(tmp_path / "x0.npy", xs[0])
    one = runner.invoke(app, ["robustness", str(path), "--at", str(tmp_path / "x0.npy"),
                              "--label", str(labels[0]), "--radius", "0.001", "--json"])
    assert one.exit_code == 0 and json.loads(one.stdout)["status"] == "certified"
    nan = xs.copy()
    nan[1, 2, 3] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    np.save(tmp_path / "big.npy", np.array([0, 0, 9]))
    np.save(tmp_path / "empty.npy", xs[:0])
    np.save(tmp_path / "none.npy", labels[:0])
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}] * 3, dtype=object), allow_pickle=True)
    for args, msg in [
        (["--inputs", str(xi), "--labels", str(yi)], "--inputs needs --radius"),
        (["--inputs", str(xi), "--radius", "0.1"], "--inputs and --labels go together"),
        (["--at", str(xi), "--label", "0", "--labels", str(yi), "--radius", "0.1"],
         "not both"),
        (["--inputs", str(xi), "--labels", str(yi), "--radius", "-1"], "--radius must be"),
        (["--inputs", str(xi), "--labels", str(yi), "--radius", "0.1",
          "--min-certified-accuracy", "2"], "in [0, 1]"),
        (["--at", str(tmp_path / "x0.npy"), "--label", "0", "--min-certified-accuracy",
          "0.5"], "needs --inputs"),
        (["--inputs", str(xi), "--labels", str(xi), "--radius", "0.1"], "integer class"),
        (["--at", str(tmp_path / "x0.npy"), "--label", "0", "--server", "http://127.0.0.1:1"],
         "--server takes --inputs"),
        (["--at", str(tmp_path / "x0.npy"), "--label", "0", "--radius", "0.1", "--workers",
          "2"], "--workers decides a set"),
        (["--inputs", str(tmp_path / "nan.npy"), "--labels", str(yi), "--radius", "0.1"],
         "inputs[1]: the input has non-finite entries"),
        (["--inputs", str(xi), "--labels", str(tmp_path / "big.npy"), "--radius", "0.1"],
         "labels[2]: label must be in 0..3"),
        (["--inputs", str(tmp_path / "empty.npy"), "--labels", str(tmp_path / "none.npy"),
          "--radius", "0.1"], "give at least one input"),
        (["--inputs", str(path), "--labels", str(yi), "--radius", "0.1"], "not a .npy file"),
        (["--inputs", str(tmp_path / "obj.npy"), "--labels", str(yi), "--radius", "0.1"],
         "holds Python objects (a pickle), which lsa does not load"),
    ]:
        bad = runner.invoke(app, ["robustness", str(path), *args])
        assert bad.exit_code == 2 and msg in bad.stderr, (args, bad.stderr)
    np.save(yi, labels[:2])
    bad = runner.invoke(app, base)
    assert bad.exit_code == 2 and "one label each" in bad.stderr


class _Tiny(nn.Module):
    """A small attention classifier (one head, LayerNorm, GELU head) in plain torch ops, its
    weights scaled by `gain`: random models for the property below."""

    def __init__(self, seed: int, gain: float) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ln = nn.LayerNorm(4)
        self.qkv = nn.Linear(4, 12)
        self.head = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, 3, 4)
        q, k, v = self.qkv(self.ln(x)).split(4, dim=-1)  # (1, 3, 4) each
        p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)  # (1, 3, 3)
        h = x + p @ v  # (1, 3, 4)
        return self.head(h.mean(dim=1))  # (1, 3)


@settings(max_examples=at_most(12), deadline=None)  # an example costs ~0.4 s on 2 shared cores
@given(seed=st.integers(0, 10_000), gain=st.floats(0.5, 2.0),
       frac=st.floats(0.05, 1.0), norm=st.sampled_from(["2", "inf"]))
def test_decide_certified_never_flips_on_random_models(tmp_path_factory: pytest.TempPathFactory,
                                                       seed: int, gain: float, frac: float,
                                                       norm: str) -> None:
    """On random small attention classifiers and radii (a fraction of the first-order radius
    m / ||grad m||, where flips begin to be possible): a certified verdict has no flip among
    boundary points and PGD's; an attacked one carries a float64-checked flip in the ball."""
    model = _Tiny(seed, gain).eval()
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(seed))
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=18,
                      input_names=["x"], output_names=["logits"])
    om = load_onnx(path.read_bytes())
    x0 = x.double().numpy()
    label = _label(om, x0)
    f = om.module.with_dtype(torch.float64)
    t = torch.from_numpy(x0).requires_grad_(True)
    y = f(t).reshape(-1)
    first = min(float(y[label] - y[j]) / max(float(g.abs().sum() if norm == "inf"
                                                   else g.norm()), 1e-12)
                for j in range(3) if j != label
                for (g,) in [torch.autograd.grad(y[label] - y[j], t, retain_graph=True)])
    r = max(frac * first, 1e-4)
    v = decide(om, x0, label, norm, r)
    if v.status == "certified":
        _holds(om, x0, label, r, norm)
    elif v.status == "attacked":
        assert v.flip is not None and v.flip_distance is not None and v.flip_distance <= r
        with torch.no_grad():
            out = f(torch.from_numpy(v.flip)).reshape(-1)
        assert float(out[v.flip_class]) > float(out[label])


def test_robustness_cli_set_mode_cuts_images_into_patches(tmp_path: Path) -> None:
    """On an upload on pixels the inputs are images (S, C, H, W), each cut into the patches
    the graph is analysed on (service.bounds.local.model_input); an image of another shape is
    refused naming its index."""
    from tests.test_local_conv import _PixelNet
    from tests.test_onnx_recognition import _export

    m = _PixelNet().eval()
    path = tmp_path / "px.onnx"
    path.write_bytes(_export(m, torch.randn(1, 2, 4, 4), tmp_path / "px0.onnx", False))
    imgs = np.random.default_rng(3).standard_normal((4, 2, 4, 4))
    with torch.no_grad():
        labels = m(torch.from_numpy(imgs).float()).argmax(-1).numpy()
    xi, yi = tmp_path / "imgs.npy", tmp_path / "ys.npy"
    np.save(xi, imgs)
    np.save(yi, labels)
    runner = CliRunner()
    res = runner.invoke(app, ["robustness", str(path), "--inputs", str(xi), "--labels",
                              str(yi), "--radius", "0.01", "--norm", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["n"] == 4 and out["counts"]["misclassified"] == 0
    assert out["counts"]["certified"] >= 1
    np.save(xi, imgs[:, :, :3])
    bad = runner.invoke(app, ["robustness", str(path), "--inputs", str(xi), "--labels",
                              str(yi), "--radius", "0.01"])
    assert bad.exit_code == 2 and "inputs[0]: shape (2, 3, 4)" in bad.stderr


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_sweep_never_passes_the_first_order_radius(mlp: tuple[OnnxModel, Path],
                                                   norm: str) -> None:
    """decide skips the sweep past min_j m_j / ||grad m_j(X0)||_dual: the radius search's
    sweep (run to the end, no other route's floor) stays below it on the MLP, where the sweep
    is the route that wins."""
    from lsa_models.engine.routes import certify as local
    from lsa_models.engine.routes import sweep

    om, _ = mlp
    for seed in (5, 6):
        x0 = center(seed).numpy().astype(np.float64)
        label = _label(om, x0)
        _, x, f64, margins, _ = local.centre_margins(om, x0, label, norm)
        reach = at_radius._sweep_reach(f64, x, label, margins, norm)
        best, runs, _ = sweep._sweep(om, x, norm, label, margins, 30,
                                     adjoint=norm in sweep.ADJOINT_NORMS)
        assert 0 < best <= reach and runs >= 3


class _TokensFirst(nn.Module):
    """A classifier of one (N, D) input with no batch axis: its first axis is the tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.mix, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, D) -> (3,)
        return self.head(torch.tanh(self.mix(x)).mean(0))


def test_margins_on_a_graph_without_a_batch_axis(tmp_path: Path) -> None:
    """On an (N, D) graph the centre's margins are the model's own (the graph run on X0 as its
    input, not row by row as a batch of N), and a verdict at a radius is reached."""
    from lsa_models.engine.routes.certify import centre_margins

    net = _TokensFirst().eval()
    x0 = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    torch.onnx.export(net, (x0,), tmp_path / "tokens.onnx", dynamo=False)
    om = load_onnx((tmp_path / "tokens.onnx").read_bytes())
    assert om.spec.rank == 2
    x = x0.numpy().astype(np.float64)
    with torch.no_grad():
        want = net.double()(torch.from_numpy(x)).numpy()
    label = int(np.argmax(want))
    _, _, f64, margins, predicted = centre_margins(om, x, label, "inf")
    assert predicted == label and sorted(margins) == [j for j in range(3) if j != label]
    for j, m in margins.items():
        assert m == pytest.approx(want[label] - want[j], abs=1e-6)
    assert tuple(f64(torch.from_numpy(x)).shape) == want.shape
    v = decide(om, x, label, "inf", 1e-4)
    assert v.status == "certified"


def test_margins_on_a_tokens_first_graph(tmp_path: Path) -> None:
    """On the zoo's (N, 1, D) graph (tokens first, the batch axis second) the centre's
    margins are the model's own."""
    from lsa_models.engine.routes.certify import centre_margins
    from tests.zoo.cases import _cases_l2

    (case,) = [c for c in _cases_l2() if c.key == "l2-stpp[(N, 1, D)]"]
    built = case.build()
    torch.onnx.export(built.module, (built.example,), tmp_path / "stpp.onnx", dynamo=False)
    om = load_onnx((tmp_path / "stpp.onnx").read_bytes())
    x = built.example.numpy().astype(np.float64)
    with torch.no_grad():
        want = built.module.double()(torch.from_numpy(x)).reshape(-1).numpy()
    label = int(np.argmax(want))
    # the input as the engine takes it: (N, D), the graph's (N, 1, D) read from it
    _, _, _, margins, predicted = centre_margins(om, x.reshape(x.shape[0], -1), label, "2")
    assert predicted == label and len(margins) == want.size - 1
    for j, m in margins.items():
        assert m == pytest.approx(want[label] - want[j], abs=1e-6)
