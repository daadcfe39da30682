"""docs/ci.md: its GitHub Actions workflow and GitLab CI job parse, and the `lsa` commands in
them run as written (with the pipelines' own variables) against models made here."""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from api_schemas.ci import CertifyReport
from lsa_models import L2MHA, save
from service.bounds.files import compute_report

from .test_e2e_server import Server, clean_env, running_server

DOC = Path(__file__).resolve().parent.parent / "docs" / "ci.md"


def yaml_blocks() -> list[dict[str, Any]]:
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOC.read_text(), re.M | re.S)
    return [yaml.safe_load(b) for b in blocks]


def github_workflow() -> dict[str, Any]:
    # PyYAML reads the bare key `on` as the boolean True (YAML 1.1).
    (wf,) = [b for b in yaml_blocks() if "jobs" in b and ("on" in b or True in b)]
    return wf


def gitlab_job() -> tuple[str, dict[str, Any]]:
    jobs = [(name, job) for b in yaml_blocks() for name, job in b.items()
            if isinstance(job, dict) and "script" in job]
    assert len(jobs) == 1
    return jobs[0]


def lsa_commands(script: str) -> list[str]:
    """Shell lines that run `lsa`, with backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("lsa ")]


def github_commands(wf: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    (job,) = wf["jobs"].values()
    commands = [c for step in job["steps"] if "run" in step for c in lsa_commands(step["run"])]
    return {k: str(v) for k, v in job["env"].items()}, commands


def gitlab_commands(job: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    commands = [c for line in job["script"] for c in lsa_commands(line)]
    return {k: str(v) for k, v in job["variables"].items()}, commands


def run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=300)


def model_with_bound(path: Path, seq_len: int, below: float | None = None,
                     above: float | None = None) -> float:
    """Save an L2 attention model whose certified bound lies below/above the given value
    (weights rescaled until it does); returns the bound."""
    torch.manual_seed(7)
    model = L2MHA(8, 2)
    for _ in range(60):
        save(model, path)
        upper = compute_report(path, "2", seq_len, None).upper
        assert upper is not None
        if below is not None and upper > below:
            factor = 0.7
        elif above is not None and upper < above:
            factor = 1.5
        else:
            return upper
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(factor)
    raise AssertionError("could not place the bound")


def test_ci_docs_pipelines_parse_and_gate_with_lsa() -> None:
    wf = github_workflow()
    env, commands = github_commands(wf)
    assert [c.split()[1] for c in commands] == ["certify", "verify"]
    assert {"MODEL", "MAX_LIPSCHITZ", "SEQ_LEN"} <= set(env)
    name, job = gitlab_job()
    env, commands = gitlab_commands(job)
    assert [c.split()[1] for c in commands] == ["certify", "verify"]
    assert all("--server" in c for c in commands)
    assert job["artifacts"]["reports"]["junit"] in commands[0]


def _workspace(tmp_path: Path, env: dict[str, str]) -> dict[str, Path]:
    (tmp_path / Path(env["MODEL"]).parent).mkdir(parents=True, exist_ok=True)
    seq_len, threshold = int(env["SEQ_LEN"]), float(env["MAX_LIPSCHITZ"])
    good = tmp_path / "good.safetensors"
    bad = tmp_path / "bad.safetensors"
    model_with_bound(good, seq_len, below=threshold * 0.8)
    model_with_bound(bad, seq_len, above=threshold * 1.25)
    return {"good": good, "bad": bad, "model": tmp_path / env["MODEL"]}


def test_ci_docs_github_workflow_commands_run(tmp_path: Path) -> None:
    env, commands = github_commands(github_workflow())
    runner_temp = tmp_path / "runner-temp"
    runner_temp.mkdir()
    env = {k: v.replace("${{ runner.temp }}", str(runner_temp)) for k, v in env.items()}
    assert all("${{" not in v for v in env.values())
    summary = tmp_path / "step-summary.md"
    env["GITHUB_STEP_SUMMARY"] = str(summary)
    ws = _workspace(tmp_path, env)
    certify, verify = commands

    ws["model"].write_bytes(ws["good"].read_bytes())
    proc = run(certify, tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    report = CertifyReport.model_validate_json((tmp_path / "lsa-report.json").read_text())
    assert report.certificate.threshold == float(env["MAX_LIPSCHITZ"])
    assert report.certificate.seq_len == int(env["SEQ_LEN"])
    assert Path(env["LSA_SIGNING_KEY_PATH"]).is_file()  # signed with the job's key path
    assert "lsa certify passed" in summary.read_text()
    proc = run(verify, tmp_path, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # A pull request that makes the bound too large fails the step.
    ws["model"].write_bytes(ws["bad"].read_bytes())
    proc = run(certify, tmp_path, env)
    assert proc.returncode == 1, proc.stderr
    failure = ET.parse(tmp_path / "lsa-junit.xml").getroot().find("testsuite/testcase/failure")
    assert failure is not None and "exceeds the threshold" in (failure.get("message") or "")
    assert "lsa certify failed" in summary.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with running_server(tmp_path_factory.mktemp("docs-server")) as s:
        yield s


def test_ci_docs_gitlab_job_commands_run_against_a_server(server: Server,
                                                          tmp_path: Path) -> None:
    _, job = gitlab_job()
    env, commands = gitlab_commands(job)
    env.update(LSA_SERVER=server.url, LSA_API_KEY=server.api_key)
    ws = _workspace(tmp_path, env)
    certify, verify = commands

    ws["model"].write_bytes(ws["good"].read_bytes())
    proc = run(certify, tmp_path, env)
    assert proc.returncode == 0, proc.stderr + server.log_tail()
    for artifact in job["artifacts"]["paths"]:
        assert (tmp_path / artifact).is_file(), artifact
    report = CertifyReport.model_validate_json((tmp_path / "lsa-report.json").read_text())
    assert report.source == "server" and report.certificate.passed
    proc = run(verify, tmp_path, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    ws["model"].write_bytes(ws["bad"].read_bytes())
    proc = run(certify, tmp_path, env)
    assert proc.returncode == 1, proc.stderr
    junit = tmp_path / job["artifacts"]["reports"]["junit"]
    assert ET.parse(junit).getroot().get("failures") == "1"


def robustness_gate_command() -> str:
    """The `lsa robustness` command of docs/ci.md's "Gating robustness" block, continuations
    joined."""
    text = DOC.read_text().split("## Gating robustness on a set of inputs", 1)[1]
    (block,) = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)[:1]
    (command,) = lsa_commands(block)
    return command


def test_ci_docs_robustness_gate_command_runs(tmp_path: Path) -> None:
    """The robustness gate as docs/ci.md writes it, on a classifier made here and four
    held-out inputs labelled by it: exit 0 or 1 by the threshold in the command, and every
    report it names is written and agrees with the JSON."""
    import json

    import numpy as np

    from bench.local_models import build, center, export

    command = robustness_gate_command()
    model = build("mlp", seed=4)
    export(model, tmp_path / "model.onnx")
    xs = np.stack([center(s).numpy().astype(np.float32).reshape(8, 16) for s in (5, 6, 7, 8)])
    with torch.no_grad():
        ys = model(torch.from_numpy(xs)).argmax(-1).numpy()
    np.save(tmp_path / "heldout_x.npy", xs)
    np.save(tmp_path / "heldout_y.npy", ys)
    summary = tmp_path / "step-summary.md"
    proc = run(command, tmp_path, {"MODEL": "model.onnx", "GITHUB_STEP_SUMMARY": str(summary)})
    out = json.loads((tmp_path / "lsa-robustness.json").read_text())
    gate = float(re.search(r"--min-certified-accuracy (\S+)", command).group(1))  # type: ignore[union-attr]
    assert proc.returncode == (0 if out["certified_accuracy"] >= gate else 1), proc.stderr
    suite = ET.parse(tmp_path / "lsa-robustness-junit.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == str(out["n"] + 1)
    assert f"certified accuracy {out['certified_accuracy']:.4f}" in summary.read_text()
    flips = np.load(tmp_path / "lsa-counterexamples.npz")
    assert flips["index"].tolist() == [s["index"] for s in out["samples"]
                                       if s["status"] == "attacked"]
