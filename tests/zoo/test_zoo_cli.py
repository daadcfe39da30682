"""A few zoo exports through `lsa bound --json` end to end: the CLI says what the library
says (verdict and bound), and a refused graph exits 2 with one line naming the problem."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from service.cli import app

from .cases import CASES, Case
from .conftest import Zoo

runner = CliRunner()

# (model, layout, exporter): certified DP behind LayerNorm, certified tied L2 on (N, D),
# not_lipschitz post-norm, and one that lsa refuses today (or reads, once it can)
CLI_CASES = [("torch-mha-causal-prenorm", "(1, N, D)", "dynamo"),
             ("l2-expanded", "(N, D)", "torchscript"),
             ("torch-decoder-postnorm", "(1, N, D)", "torchscript"),
             ("hf-vit", "pixels", "torchscript")]


def _case(model: str, layout: str) -> Case:
    return next(c for c in CASES if c.model == model and c.layout == layout)


@pytest.mark.parametrize(("model", "layout", "exporter"), CLI_CASES)
def test_zoo_cli_bound_matches_library(zoo: Zoo, model: str, layout: str,
                                       exporter: str) -> None:
    case = _case(model, layout)
    path = zoo.file(case, exporter)
    lib = zoo.outcome(case, exporter)
    res = runner.invoke(app, ["bound", str(path), "--json"])
    if lib.verdict == "refused":
        assert res.exit_code == 2, res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lsa: error:")
        assert lib.reason is not None and lib.reason[:40] in lines[0]
        return
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["verdict"] == lib.verdict
    assert report["upper"] == lib.upper
