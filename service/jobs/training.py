"""The `train_certified` job (queue `training`): train a character-level LM with
`lsa_models.training.train_certified`, then store the native model, its ONNX export, the PNG
of the training curves and a signed certificate, and register the model.

Work files live in `<artifact_dir>/training/<job id>/`; with `checkpoint_every` a job re-run
after its worker died resumes from the newest checkpoint there. The directory is removed when
the job ends any other way.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..tables import CertificateRow
from .registry import JobKind, register_job_kind
from .runner import JobContext

# Training progress writes at most this often (the fenced write is also the cancel check).
PROGRESS_INTERVAL_S = 0.5
TRAINING_SHARE = 0.97


class TrainingJobParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request: dict[str, Any]  # lsa_models.training.TrainRequest.to_dict()
    corpus_id: str | None  # None: PTB
    corpus_sha256: str | None


def work_dir(ctx: JobContext) -> Path:
    return Path(ctx.runtime.settings.artifact_dir) / "training" / ctx.job_id


def run_training(ctx: JobContext) -> dict[str, Any]:
    from ..training import certificate_id_for_job, result_from_certificate

    p = TrainingJobParams.model_validate(ctx.params)
    with ctx.session() as s:
        done = s.get(CertificateRow, certificate_id_for_job(ctx.job_id))
        if done is not None:  # a re-run after a crash: the first run stored everything
            return result_from_certificate(dict(done.body), done.model_id)
    key_path = Path(ctx.runtime.settings.signing_key_path)
    if not key_path.is_file():
        # A worker must sign with the server's key (the one GET /certificates/public-key
        # shows); creating its own would issue certificates nobody can verify.
        raise ValueError(f"the signing key LSA_SIGNING_KEY_PATH={key_path} does not exist on "
                         "this worker: share the server's key file with its workers")
    ctx.progress(0.0, "loading corpus", force=True)
    from lsa_models.training import TrainRequest, train_certified

    request = TrainRequest.from_dict(p.request)
    text: str | None = None
    if p.corpus_sha256 is not None:
        try:
            text = ctx.runtime.artifacts.read_bytes(p.corpus_sha256).decode("utf-8")
        except FileNotFoundError:
            raise ValueError(f"the text of corpus {p.corpus_id} is missing from "
                             "LSA_ARTIFACT_DIR: the server and its workers must share that "
                             "directory") from None
    last = float("-inf")

    def progress(fraction: float, message: str, details: dict[str, Any]) -> None:
        nonlocal last
        # train_certified's 0..1 (its "done" included) maps onto 0..0.97: storing follows.
        fraction = TRAINING_SHARE * fraction
        if message != "training":
            ctx.progress(fraction, message, force=True)
            return
        step, steps = int(details["step"]), int(details["steps"])
        now = time.monotonic()
        if step < steps and now - last < PROGRESS_INTERVAL_S:
            return
        last = now
        # Raises JobAborted when the job was cancelled: training stops at this step.
        ctx.progress(fraction, f"training: step {step}/{steps}, "
                     f"{float(details['bpc']):.3f} bits/char, "
                     f"{float(details['tokens_per_s']):.0f} tokens/s", force=True)

    out_dir = work_dir(ctx)
    try:
        outcome = train_certified(request, text, out_dir, progress)
        ctx.progress(0.98, "storing model, ONNX, plot and certificate", force=True)
        from ..training import store_outcome

        corpus = {"id": p.corpus_id or "ptb", "sha256": p.corpus_sha256}
        with ctx.session() as s:
            result = store_outcome(s, ctx.runtime, ctx.job_id, outcome, corpus)
    except BaseException as exc:
        # A stopping worker (shutdown, interrupt) leaves the job to be re-run: keep its
        # checkpoints. Failure and cancellation end the job: nothing will resume.
        if not (isinstance(exc, (KeyboardInterrupt, SystemExit))
                or type(exc).__name__ == "Shutdown"):
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


register_job_kind(JobKind("train_certified", queue="training", handler=run_training,
                          params_schema=TrainingJobParams))
