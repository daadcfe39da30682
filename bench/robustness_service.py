"""Robustness certificates through the service, in one run against its own baseline: the
radii computed directly (`service.robustness.verdicts.robustness_of`, what POST /certify did
inside the request before it became a job) beside the service's flow: the 202 of the first
request, its job to the certificate, and a second request for another min_radius (the stored
radii: 201).
One in-process server (SQLite, in-process worker), the classifiers of bench/local_models.py.
Writes bench/out/robustness_service.json and prints it.

    .venv/bin/python bench/robustness_service.py [--kinds mlp tf1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.local_models import build, center, export  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def predicted(model: torch.nn.Module, x0: np.ndarray) -> int:
    with torch.no_grad():
        return int(model.double()(torch.from_numpy(x0)).argmax())


def run_kind(c: Any, kind: str, root: Path) -> dict[str, Any]:
    from service.kit.inputs import load_model
    from service.robustness.verdicts import robustness_of

    net = build(kind, seed=0)
    path = export(net, root / f"{kind}.onnx")
    x0 = center(1).numpy().astype(np.float64)  # (1, N, D)
    label = predicted(net, x0)
    t = time.perf_counter()
    direct = robustness_of(load_model(path), "0" * 64, x0, label, "2")
    direct_s = time.perf_counter() - t

    m = c.post("/models", files={"file": (path.name, path.read_bytes(),
                                          "application/octet-stream")}).json()
    req = {"model_id": m["id"], "norm": "2", "at": x0.tolist(), "label": label}
    t = time.perf_counter()
    r = c.post("/certify", json={**req, "min_radius": 1e-6})
    accepted_s = time.perf_counter() - t
    assert r.status_code == 202, r.text
    stages: list[str] = []
    while (job := c.get(r.json()["url"]).json())["status"] in ("queued", "running"):
        if job["stage"] and (not stages or stages[-1] != job["stage"]):
            stages.append(job["stage"])
        time.sleep(0.05)
    job_s = time.perf_counter() - t
    assert job["status"] == "succeeded", job
    t = time.perf_counter()
    second = c.post("/certify", json={**req, "min_radius": 1.0})
    cached_s = time.perf_counter() - t
    assert second.status_code == 201, second.text
    radius = job["result"]["robustness"]["certified_radius"]
    assert second.json()["robustness"]["certified_radius"] == radius == \
        direct["certified_radius"]
    return {"kind": kind, "certified_radius": radius,
            "sweep_runs": direct["sweep_runs"],
            "direct_s": direct_s, "first_request_202_s": accepted_s,
            "job_to_certificate_s": job_s, "second_min_radius_201_s": cached_s,
            "stages_seen": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kinds", nargs="+", default=["mlp", "tf1"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.db import upgrade
    from service.settings import Settings

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'lsa.db'}"
        upgrade(url)
        settings = Settings(database_url=url, artifact_dir=root / "artifacts",
                            signing_key_path=root / "key.pem", migrate_on_start=False,
                            redis_url=None)
        with TestClient(create_app(settings)) as c:
            for kind in args.kinds:
                rows.append(run_kind(c, kind, root))
    OUT.mkdir(exist_ok=True)
    text = json.dumps({"rows": rows}, indent=2)
    (OUT / "robustness_service.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
