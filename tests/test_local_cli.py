"""`lsa bound MODEL --at X0.npy --eps E`: the local report and its input errors (exit 2)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.local_models import build, center, export
from service.cli import app


@pytest.fixture(scope="module")
def tf1_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(build("tf1", seed=2), tmp_path_factory.mktemp("cli") / "tf1.onnx")


def test_local_cli_json_has_domain_and_local_upper(tf1_path: Path, tmp_path: Path) -> None:
    x0 = center(1).numpy()
    np.save(tmp_path / "x0.npy", x0[0])  # (N, D): no batch dimension
    res = CliRunner().invoke(app, ["bound", str(tf1_path), "--at", str(tmp_path / "x0.npy"),
                                   "--eps", "0.01", "--json", "--empirical", "--restarts",
                                   "1", "--steps", "2"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    sha = hashlib.sha256(x0.astype("<f8").tobytes()).hexdigest()
    assert out["domain"] == {"kind": "ball", "norm": "2", "eps": 0.01, "center_sha256": sha}
    assert out["verdict"] == "certified" and out["lower"] <= out["upper"]
    glob = CliRunner().invoke(app, ["bound", str(tf1_path), "--json"])
    assert json.loads(glob.stdout)["upper"] > 100 * out["upper"]  # LayerNorm's 316 is gone
    assert any(lb["global_upper"] and lb["rule"] for lb in out["layers"])


@pytest.mark.parametrize(("args", "message"), [
    (["--eps", "0.1"], "--eps needs --at"),
    (["--at", "X"], "--at needs --eps"),
    (["--at", "X", "--eps", "-1"], "--eps must be finite and >= 0"),
    (["--at", "BAD", "--eps", "0.1"], "shape"),
    (["--at", "missing.npy", "--eps", "0.1"], "no such file"),
])
def test_local_cli_bad_input_exits_2(tf1_path: Path, tmp_path: Path, args: list[str],
                                     message: str) -> None:
    np.save(tmp_path / "x.npy", center(1).numpy())
    np.save(tmp_path / "bad.npy", np.zeros((3, 16)))
    paths = {"X": str(tmp_path / "x.npy"), "BAD": str(tmp_path / "bad.npy"),
             "missing.npy": str(tmp_path / "missing.npy")}
    res = CliRunner().invoke(app, ["bound", str(tf1_path)] + [paths.get(a, a) for a in args])
    assert res.exit_code == 2 and message in res.stderr, res.output


def test_local_cli_native_model_goes_through_the_same_engine(tmp_path: Path) -> None:
    import lsa_models

    model = lsa_models.Transformer(lsa_models.TransformerConfig(d_model=8, n_heads=2,
                                                                n_layers=1, d_ff=16))
    lsa_models.save(model, tmp_path / "m.safetensors")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((6, 8)))
    res = CliRunner().invoke(app, ["bound", str(tmp_path / "m.safetensors"), "--at",
                                   str(tmp_path / "x.npy"), "--eps", "0.01", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    glob = json.loads(CliRunner().invoke(app, ["bound", str(tmp_path / "m.safetensors"),
                                               "--seq-len", "6", "--json"]).stdout)
    assert out["verdict"] == "certified" and out["upper"] < glob["upper"]
    assert out["domain"]["eps"] == 0.01
