"""`lsa bound`: table, JSON matching the API schema, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import lsa_models
from api_schemas import BoundReport
from lsa_models import Transformer, TransformerConfig
from service.cli import app

runner = CliRunner()


@pytest.fixture
def l2_model(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16))
    return lsa_models.save(model, tmp_path / "l2.safetensors")


@pytest.fixture
def dp_model(tmp_path: Path) -> Path:
    model = Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16,
                                          attention="dp", norm_first=False))
    return lsa_models.save(model, tmp_path / "dp.safetensors")


def test_lsa_bound_json_matches_the_schema_and_the_library(l2_model: Path) -> None:
    res = runner.invoke(app, ["bound", str(l2_model), "--norm", "inf", "--seq-len", "32",
                              "--json"])
    assert res.exit_code == 0, res.output
    report = BoundReport.model_validate_json(res.stdout)
    expected = lsa_models.certify(lsa_models.load(l2_model), "inf", 32)
    assert report.upper == expected.upper and report.lipschitz is True
    assert report.seq_len == 32 and report.norm == "inf"
    assert report.model_sha256 == lsa_models.analysis.sha256_hex(l2_model.read_bytes())
    assert {"blocks.0.attn", "blocks.1"} <= {lb.name for lb in report.layers}
    assert report.lsa_version == lsa_models.__version__ and report.method


def test_lsa_bound_on_dp_model_reports_not_lipschitz(dp_model: Path) -> None:
    res = runner.invoke(app, ["bound", str(dp_model), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["lipschitz"] is False and data["upper"] is None
    assert data["verdict"] == "not_lipschitz"


def test_lsa_bound_table_shows_layers_and_total(l2_model: Path) -> None:
    res = runner.invoke(app, ["bound", str(l2_model)], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "blocks.0.attn" in res.stdout and "certified" in res.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--norm", "3"], "--norm must be 2 or inf"),
        (["--seq-len", "0"], "seq_len must be >= 1"),
    ],
)
def test_lsa_bound_bad_options_exit_2(l2_model: Path, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["bound", str(l2_model), *args])
    assert res.exit_code == 2
    assert message in res.stderr


def test_lsa_bound_on_garbage_file_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x00" * 100)
    proc = subprocess.run([sys.executable, "-m", "service.cli", "bound", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lsa: error:")


def test_lsa_bound_on_missing_file_exits_2(tmp_path: Path) -> None:
    res = runner.invoke(app, ["bound", str(tmp_path / "nope.safetensors")])
    assert res.exit_code == 2 and "no such file" in res.stderr
