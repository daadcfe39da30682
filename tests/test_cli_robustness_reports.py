"""The robustness gate's reports (`lsa robustness --inputs ... --junit --summary
--counterexamples`): the JUnit XML and the Markdown summary say what the JSON says, every
counterexample is a checked label flip inside the ball in the layout the input was given in,
and a bad option or input still leaves an error report."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bench.local_models import build, center, export
from lsa_models.onnx import load_onnx
from service.bounds.local import model_image, model_input
from service.cli import app


@pytest.fixture(scope="module")
def mlp_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, np.ndarray]:
    """The MLP of the radius tests (seed 4) and four inputs labelled by its predictions: at
    inf radius 0.05 some are certified and at least one is attacked."""
    tmp = tmp_path_factory.mktemp("reports")
    model = build("mlp", seed=4)
    path = export(model, tmp / "mlp.onnx")
    xs = np.stack([center(s).numpy().astype(np.float32).reshape(8, 16) for s in (5, 6, 7, 8)])
    with torch.no_grad():
        ys = model(torch.from_numpy(xs)).argmax(-1).numpy()
    np.save(tmp / "xs.npy", xs)
    np.save(tmp / "ys.npy", ys)
    return path, tmp / "xs.npy", tmp / "ys.npy", xs


def _run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, ["robustness", *args])
    return res.exit_code, res.stdout, res.stderr


def test_robustness_reports_say_what_the_json_says(mlp_set: tuple[Path, Path, Path, np.ndarray],
                                                   tmp_path: Path) -> None:
    path, xi, yi, xs = mlp_set
    junit, summary, ce = tmp_path / "j.xml", tmp_path / "s.md", tmp_path / "ce.npz"
    code, stdout, _ = _run(str(path), "--inputs", str(xi), "--labels", str(yi), "--norm", "inf",
                           "--radius", "0.05", "--min-certified-accuracy", "1", "--json",
                           "--junit", str(junit), "--summary", str(summary),
                           "--counterexamples", str(ce))
    out = json.loads(stdout)
    k = out["counts"]
    assert k["attacked"] >= 1 and k["certified"] >= 1  # the fixture's premise
    assert code == 1 and out["passed"] is False
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert suite.get("tests") == str(out["n"] + 1) and suite.get("failures") == "1"
    assert suite.get("skipped") == str(out["n"] - k["certified"])
    gate, *cases = suite.findall("testcase")
    failure = gate.find("failure")
    assert failure is not None and failure.get("type") == "CertifiedAccuracyBelowThreshold"
    for case, s in zip(cases, out["samples"], strict=True):
        skipped = case.find("skipped")
        assert (skipped is None) == (s["status"] == "certified")
        if s["status"] == "attacked":
            assert skipped is not None and f"flipped to {s['flip_class']}" in str(
                skipped.get("message"))
    text = summary.read_text()
    assert text.startswith("### ❌ lsa robustness failed") and out["model_sha256"] in text
    assert text.count("\n| ") >= out["n"] + 8  # one row per input, beside the table
    # a second gate's summary is appended (one $GITHUB_STEP_SUMMARY for every step)
    code, _, _ = _run(str(path), "--inputs", str(xi), "--labels", str(yi), "--norm", "inf",
                      "--radius", "0.05", "--summary", str(summary))
    assert code == 0 and summary.read_text().startswith(text)
    assert "### 📋 lsa robustness report" in summary.read_text()

    flips = np.load(ce)
    attacked = [s["index"] for s in out["samples"] if s["status"] == "attacked"]
    assert flips["index"].tolist() == attacked
    f64 = load_onnx(path.read_bytes()).module.with_dtype(torch.float64)
    for i, y, c, dist, x in zip(flips["index"], flips["label"], flips["flip_class"],
                                flips["distance"], flips["inputs"], strict=True):
        assert x.shape == xs[i].shape and x.dtype == np.float64
        d = np.abs(x - xs[i].astype(np.float64)).max()
        assert d <= 0.05 and d == pytest.approx(dist, rel=1e-12)
        with torch.no_grad():
            logits = f64(torch.from_numpy(x[None]))[0]
        assert int(logits.argmax()) == c != y


def test_robustness_reports_on_errors_and_option_misuse(
        mlp_set: tuple[Path, Path, Path, np.ndarray], tmp_path: Path) -> None:
    """Exit 2 still writes the JUnit error case and the summary (the CI job shows why it
    stopped); options that do not go with the mode are refused naming them."""
    path, xi, yi, _ = mlp_set
    junit, summary = tmp_path / "j.xml", tmp_path / "s.md"
    code, _, stderr = _run(str(path), "--inputs", str(xi), "--labels", str(yi), "--radius",
                           "-1", "--junit", str(junit), "--summary", str(summary))
    assert code == 2 and "--radius must be" in stderr
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("errors") == "1" and suite.get("tests") == "1"
    err = suite.find("testcase/error")
    assert err is not None and "--radius must be" in str(err.get("message"))
    assert summary.read_text().startswith("### ⚠️ lsa robustness error")
    np.save(tmp_path / "x0.npy", np.load(xi)[0])
    x0 = str(tmp_path / "x0.npy")
    for args, msg in [
        (["--at", x0, "--label", "0", "--radius", "0.1", "--junit", str(junit)],
         "--junit and --summary report a gate on a set"),
        (["--at", x0, "--label", "0", "--counterexamples", str(tmp_path / "c.npz")],
         "--counterexamples needs --radius"),
    ]:
        code, _, stderr = _run(str(path), *args)
        assert code == 2 and msg in stderr, (args, stderr)


def test_robustness_counterexample_of_one_input_and_none_found(
        mlp_set: tuple[Path, Path, Path, np.ndarray], tmp_path: Path) -> None:
    """--at --label --radius writes its flip (index 0) when attacked, an empty file when
    certified (a CI artifact is there either way)."""
    path, xi, yi, xs = mlp_set
    out = json.loads(_run(str(path), "--inputs", str(xi), "--labels", str(yi), "--norm", "inf",
                          "--radius", "0.05", "--json")[1])
    ys = np.load(yi)
    for s in out["samples"][:3]:
        np.save(tmp_path / "x0.npy", xs[s["index"]])
        ce = tmp_path / f"ce{s['index']}.npz"
        code, stdout, _ = _run(str(path), "--at", str(tmp_path / "x0.npy"), "--label",
                               str(ys[s["index"]]), "--norm", "inf", "--radius", "0.05",
                               "--json", "--counterexamples", str(ce))
        one = json.loads(stdout)
        assert code == 0 and one["status"] == s["status"]
        flips = np.load(ce)
        assert flips["index"].tolist() == ([0] if one["status"] == "attacked" else [])
        if one["status"] == "attacked":
            assert flips["inputs"].shape == (1, 8, 16)
            assert flips["distance"][0] == pytest.approx(one["flip_distance"])


@settings(deadline=None)
@given(c=st.integers(1, 3), hp=st.integers(1, 3), wp=st.integers(1, 3), kh=st.integers(1, 3),
       kw=st.integers(1, 3), seed=st.integers(0, 100))
def test_model_image_inverts_model_input(c: int, hp: int, wp: int, kh: int, kw: int,
                                         seed: int) -> None:
    """A counterexample found on the patches goes back to the image it came from: the two
    conversions are inverse permutations of the pixels (for any patch grid)."""
    img = np.random.default_rng(seed).standard_normal((1, c, hp * kh, wp * kw))
    loaded = _pixel_loaded(c, hp * kh, wp * kw, kh, kw)
    patches = model_input(loaded, img)
    assert patches.shape == (1, hp * wp, c * kh * kw)
    assert np.array_equal(model_image(loaded, patches), img)
    assert np.array_equal(model_image(loaded, patches[0]), img)


def test_model_image_inverts_the_loaders_cut(tmp_path: Path) -> None:
    """The same on a real pixel upload (a conv patch embedding exported by torch): the image
    model_image returns is the one model_input cut, and the graph gives the same logits on
    the patches as torch on the image."""
    from lsa_models.analysis import load_model_bytes
    from tests.test_local_conv import _PixelNet
    from tests.test_onnx_recognition import _export

    m = _PixelNet().eval()
    data = _export(m, torch.randn(1, 2, 4, 4), tmp_path / "px0.onnx", False)
    loaded = load_model_bytes(data, "px.onnx")
    img = np.random.default_rng(0).standard_normal((1, 2, 4, 4))
    patches = model_input(loaded, img)
    assert patches.shape != img.shape and np.array_equal(model_image(loaded, patches), img)
    f64 = loaded.onnx.module.with_dtype(torch.float64)
    with torch.no_grad():
        assert torch.allclose(f64(torch.from_numpy(patches)),
                              m.double()(torch.from_numpy(img)), atol=1e-10)


def _pixel_loaded(c: int, h: int, w: int, kh: int, kw: int) -> object:
    """A stand-in for a loaded pixel upload: the spec patch_grid reads (the graph's first
    Reshape of the input to (B, Hp, Wp, C, kh, kw))."""
    import onnx
    from onnx import helper, numpy_helper

    shape = numpy_helper.from_array(np.array([1, h // kh, w // kw, c, kh, kw], dtype=np.int64),
                                    "shape")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g", [], [],
                              [shape])
    model = onnx.ModelProto()
    model.graph.CopyFrom(graph)

    class Spec:
        pixels = (c, h, w)
        input_name = "x"

    Spec.model = model  # type: ignore[attr-defined]

    class Onnx:
        spec = Spec

    class Loaded:
        onnx = Onnx

    return Loaded()


@pytest.mark.parametrize(("name", "norm", "radius"), [("hf-vit", "inf", 0.5),
                                                      ("timm-vit", "2", 3.0)])
def test_counterexamples_flip_the_library_model_on_images(name: str, norm: str, radius: float,
                                                          tmp_path: Path) -> None:
    """On ViTs nobody here wrote (HF transformers, timm; random weights), exported to ONNX
    and given as images: every counterexample the gate writes is an image (the layout the
    inputs were given in) within the radius of its input, on which the original torch
    model - not the graph lsa analysed - predicts the flip class."""
    import tests.zoo.tv_schemas  # noqa: F401  (before timm/transformers import torchvision)
    from bench.robustness_zoo import export_model

    model, x = export_model(name, tmp_path / "vit.onnx")
    shape = tuple(x.shape)
    gen = torch.Generator().manual_seed(2)
    xs = torch.cat([x, x + 0.3 * torch.randn(*shape, generator=gen)])  # (2, 3, H, W)
    with torch.no_grad():
        ys = model(xs).argmax(-1).numpy()
    np.save(tmp_path / "xs.npy", xs.numpy())
    np.save(tmp_path / "ys.npy", ys)
    code, stdout, stderr = _run(str(tmp_path / "vit.onnx"), "--inputs", str(tmp_path / "xs.npy"),
                                "--labels", str(tmp_path / "ys.npy"), "--norm", norm,
                                "--radius", str(radius), "--json", "--counterexamples",
                                str(tmp_path / "ce.npz"))
    assert code == 0, stderr
    out = json.loads(stdout)
    flips = np.load(tmp_path / "ce.npz")
    assert out["counts"]["attacked"] == len(flips["index"]) >= 1
    m64 = model.double()
    for i, y, c, x_flip in zip(flips["index"], flips["label"], flips["flip_class"],
                               flips["inputs"], strict=True):
        assert x_flip.shape == tuple(shape[1:])
        d = x_flip - xs[i].double().numpy()
        assert (np.abs(d).max() if norm == "inf" else np.linalg.norm(d)) <= radius
        with torch.no_grad():
            assert int(m64(torch.from_numpy(x_flip[None])).argmax()) == c != y


def test_robustness_gate_signs_a_certificate_here_that_verify_recomputes(
        mlp_set: tuple[Path, Path, Path, np.ndarray], tmp_path: Path) -> None:
    """--certificate with --key: the certified-accuracy certificate of the set, signed here
    under the server's rule (the JSON's inputs_sha256 names the set); `lsa verify
    --recompute --inputs --labels` decides it again and finds it valid; another threshold
    signs another verdict. Without the threshold, or --key with --server: exit 2."""
    path, xi, yi, _ = mlp_set
    cert, key = tmp_path / "cert.json", tmp_path / "key.pem"
    base = ["--inputs", str(xi), "--labels", str(yi), "--norm", "inf", "--radius", "0.05"]
    code, stdout, _ = _run(str(path), *base, "--min-certified-accuracy", "0.5", "--json",
                           "--certificate", str(cert), "--key", str(key))
    out = json.loads(stdout)
    signed = json.loads(cert.read_text())
    assert code == 0 and signed["id"] == out["certificate_id"] and signed["passed"] is True
    rs = signed["robustness_set"]
    assert rs["inputs_sha256"] == out["inputs_sha256"] and signed["seq_len"] == out["seq_len"]
    assert rs["statuses"] == [s["status"] for s in out["samples"]]
    assert signed["threshold"] == 0.5 and rs["radius"] == 0.05
    res = CliRunner().invoke(app, ["verify", str(cert), str(path), "--public-key", str(key),
                                   "--recompute", "--inputs", str(xi), "--labels", str(yi)])
    assert res.exit_code == 0 and "VALID: certified-accuracy certificate" in res.stdout, \
        res.output
    code, _, _ = _run(str(path), *base, "--min-certified-accuracy", "1", "--certificate",
                      str(cert), "--key", str(key))
    assert code == 1 and json.loads(cert.read_text())["passed"] is False
    for args, msg in [
        ([*base, "--certificate", str(cert)], "--certificate and --key sign"),
        ([*base, "--min-certified-accuracy", "0.5", "--server", "http://127.0.0.1:1",
          "--key", str(key)], "drop --key"),
    ]:
        code, _, stderr = _run(str(path), *args)
        assert code == 2 and msg in stderr, (args, stderr)


def test_robustness_no_sweep_leaves_the_sweeps_inputs_unknown_and_its_certificate_says_so(
        mlp_set: tuple[Path, Path, Path, np.ndarray], tmp_path: Path) -> None:
    """--no-sweep: the inputs only the radius sweep certified (on the MLP's inf-ball at 0.05)
    are unknown, the others keep their verdicts; its certificate records `sweep: false`, so
    `lsa verify --recompute` decides the set the same way and finds it valid."""
    path, xi, yi, _ = mlp_set
    base = ["--inputs", str(xi), "--labels", str(yi), "--norm", "inf", "--radius", "0.05",
            "--json"]
    full = json.loads(_run(str(path), *base)[1])
    cert, key = tmp_path / "cert.json", tmp_path / "key.pem"
    code, stdout, _ = _run(str(path), *base, "--no-sweep", "--min-certified-accuracy", "0",
                           "--certificate", str(cert), "--key", str(key))
    fast = json.loads(stdout)
    assert code == 0 and full["sweep"] is True and fast["sweep"] is False
    swept = [s["certified_by"] == "sweep" for s in full["samples"]]
    assert any(swept)  # the premise: the sweep decides some input here
    for a, b, by_sweep in zip(full["samples"], fast["samples"], swept, strict=True):
        assert b["status"] == ("unknown" if by_sweep else a["status"])
    assert json.loads(cert.read_text())["robustness_set"]["sweep"] is False
    res = CliRunner().invoke(app, ["verify", str(cert), str(path), "--public-key", str(key),
                                   "--recompute", "--inputs", str(xi), "--labels", str(yi)])
    assert res.exit_code == 0, res.output
