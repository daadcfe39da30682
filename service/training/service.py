"""The service side of training requests: the one mapping from the wire's `TrainingSpec` to
the library's configs (`training_configs`), the checks made before a job is queued (limits,
corpus), and storing a training outcome (artifacts, model row, signed certificate).

Submitting and running the job is `service.training.jobs`. The trained model is registered
like an upload: `lsa_models` loads a character-level LM as its continuous part (embedded
tokens -> logits), so POST /bound works on it.

`lsa_models` is imported inside the functions that need it: that defers torch, which the API
process never loads until a model is analysed or trained.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api_schemas.training import ArtifactLink, TrainingResult, TrainingSpec

from ..artifacts import Staged, store_artifact, store_once
from ..certificates.service import issue, training_body
from ..db import transaction
from ..errors import InvalidRequest, NotFound, Unprocessable
from ..model_cache import load_bytes
from ..settings import Settings
from ..tables import Artifact, Corpus, UploadedModel

if TYPE_CHECKING:
    from lsa_models.lm import LMConfig
    from lsa_models.training import TrainConfig, TrainOutcome

    from ..runtime import Runtime

# Certificate ids of training jobs are derived from the job id: a job re-run after a crash
# finds the certificate its first run stored instead of training again.
CERT_NAMESPACE = uuid.UUID("5b0c7d1e-6a53-4c1f-9c7e-1d2b3a4f5e60")

# The wire fields that are the model's shape (lsa_models.lm.LMConfig); the optimisation
# settings go to lsa_models.training.TrainConfig. `corpus` is the service's business.
_MODEL_FIELDS = ("d_model", "n_heads", "n_layers", "d_ff", "seq_len", "attention", "c",
                 "activation")
_TRAIN_FIELDS = ("steps", "batch_size", "lr", "warmup_steps", "fixed_lr", "weight_decay",
                 "grad_clip", "seed", "eval_every", "eval_tokens", "checkpoint_every",
                 "recon_sequences", "device")


def training_configs(spec: TrainingSpec, vocab_size: int) -> tuple[LMConfig, TrainConfig]:
    """The library's configs for a training request: the one place the wire meets the library.
    Every value the library refuses is an `InvalidRequest` naming `training.<field>`."""
    from lsa_models.config import ConfigError  # defers torch
    from lsa_models.lm import LMConfig
    from lsa_models.training import TrainConfig

    fields = spec.model_dump()
    try:
        model = LMConfig(vocab_size=vocab_size, **{k: fields[k] for k in _MODEL_FIELDS})
        train = TrainConfig(**{k: fields[k] for k in _TRAIN_FIELDS},
                            progress_every=max(1, min(50, spec.steps // 20)))
    except ConfigError as exc:
        raise InvalidRequest(f"training.{exc.field}: {exc.message}") from None
    return model, train


def certificate_id_for_job(job_id: str) -> str:
    return str(uuid.uuid5(CERT_NAMESPACE, job_id))


def split_sizes(chars: int) -> tuple[int, int, int]:
    """The 90/5/5 in-order split of `lsa_models.data.text_corpus`."""
    n_train, n_valid = chars * 90 // 100, chars * 5 // 100
    return n_train, n_valid, chars - n_train - n_valid


def check_corpus_fits(corpus: Corpus, seq_len: int) -> None:
    smallest = min(split_sizes(corpus.chars))
    if smallest < seq_len + 1:
        raise InvalidRequest(
            f"training.seq_len: {seq_len} is too long for corpus {corpus.id} ({corpus.chars} "
            f"characters; its 5% validation/test splits hold {smallest}): use seq_len <= "
            f"{max(smallest - 1, 0)} or upload a longer text")


def check_training_limits(spec: TrainingSpec, settings: Settings) -> None:
    limit = settings.max_training_steps
    if spec.steps > limit:
        raise InvalidRequest(f"training.steps: {spec.steps} exceeds LSA_MAX_TRAINING_STEPS="
                             f"{limit}; ask for fewer steps or raise the limit")
    elements = spec.batch_size * spec.n_layers * spec.seq_len * (
        spec.d_model + spec.d_ff + spec.n_heads * spec.seq_len)
    if elements > settings.max_training_elements:
        raise InvalidRequest(
            f"training.batch_size: a step of batch_size x n_layers x seq_len x (d_model + d_ff "
            f"+ n_heads x seq_len) = {elements} exceeds LSA_MAX_TRAINING_ELEMENTS="
            f"{settings.max_training_elements}: lower batch_size, seq_len or the model size")


class InvalidCorpus(Unprocessable):
    error = "invalid_corpus"


def store_corpus(runtime: Runtime, staged: Staged, filename: str) -> tuple[Corpus, bool]:
    """Store an uploaded text once, in one write transaction: (row, True) when new, (the
    stored row, False) for a text seen before; InvalidCorpus for one that is not UTF-8 or is
    empty."""
    with transaction(runtime.sessions) as session:
        def existing() -> Corpus | None:
            return session.scalar(select(Corpus).where(Corpus.sha256 == staged.sha256))

        found = existing()
        if found is not None:
            return found, False
        try:
            text = staged.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidCorpus(f"{filename} is not valid UTF-8 (byte {exc.start}: "
                                f"{exc.reason}): upload a UTF-8 encoded text file") from None
        if not text:
            raise InvalidCorpus(f"{filename} is empty: upload a text to train on")
        corpus = Corpus(sha256=staged.sha256, filename=filename, size_bytes=staged.size,
                        chars=len(text), vocab_size=len(set(text)))
        return store_once(session, runtime.artifacts, staged, "corpus", corpus, existing)


def find_corpus(runtime: Runtime, corpus_id: str) -> Corpus:
    """The stored corpus (a read-only transaction); NotFound when there is none."""
    with transaction(runtime.read_sessions) as session:
        corpus = session.get(Corpus, corpus_id)
        if corpus is None:
            raise NotFound(f"no corpus with id {corpus_id}; upload a text with POST /corpora")
        return corpus


def find_artifact(runtime: Runtime, sha256: str) -> Artifact:
    """A stored output (ONNX export, training plot, ...) whose bytes are in the artifact
    directory; NotFound otherwise."""
    with transaction(runtime.read_sessions) as session:
        row = session.get(Artifact, sha256)
        if row is None:
            raise NotFound(f"no artifact with sha256 {sha256}")
    if not runtime.artifacts.path_for(row.sha256).is_file():
        raise NotFound(f"artifact {sha256} is missing from LSA_ARTIFACT_DIR "
                       f"({runtime.settings.artifact_dir}): the server and its workers must "
                       "share that directory")
    return row


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _register_model(session: Session, job_id: str, model_sha: str, model_bytes: bytes,
                    seq_len: int) -> UploadedModel:
    model = session.scalar(select(UploadedModel).where(UploadedModel.sha256 == model_sha))
    if model is not None:
        return model
    loaded = load_bytes(model_bytes, "model.safetensors")
    summary: dict[str, Any] = json.loads(json.dumps(loaded.summary, default=str))
    summary["training_job"] = job_id
    params = summary.get("parameters")
    if params is None:
        params = sum(int(p.numel()) for p in loaded.module.parameters())
    # The LM's positional table fixes its context length: bounds and certificates are for
    # exactly the sequences it was trained on.
    model = UploadedModel(sha256=model_sha, format=loaded.format,
                  filename=f"char_lm-{job_id[:8]}.safetensors", size_bytes=len(model_bytes),
                  parameters=params, d_model=loaded.d_model, default_seq_len=seq_len,
                  fixed_seq_len=seq_len, summary=summary)
    session.add(model)
    session.flush()
    return model


def store_outcome(session: Session, runtime: Runtime, job_id: str, outcome: TrainOutcome,
                  corpus: dict[str, Any]) -> dict[str, Any]:
    """Artifacts, the model row and the signed certificate, in the caller's transaction.
    Returns the job result (api_schemas.training.TrainingResult as JSON)."""
    model_bytes = outcome.model_path.read_bytes()
    model_sha = store_artifact(session, runtime.artifacts, model_bytes, "model")
    onnx_sha = store_artifact(session, runtime.artifacts, outcome.onnx_path.read_bytes(), "onnx")
    plot_sha = store_artifact(session, runtime.artifacts, outcome.plot_path.read_bytes(), "plot")
    cert = outcome.certificate
    model = _register_model(session, job_id, model_sha, model_bytes, cert.seq_len)
    artifacts = {
        "model": ArtifactLink(sha256=model_sha, url=f"/models/{model.id}/file"),
        "onnx": ArtifactLink(sha256=onnx_sha, url=f"/artifacts/{onnx_sha}"),
        "plot": ArtifactLink(sha256=plot_sha, url=f"/artifacts/{plot_sha}"),
    }
    max_branch = cert.max_branch_lipschitz
    training_section = {
        **cert.to_json(),
        "job_id": job_id,
        "corpus": corpus,
        "artifacts": {k: v.model_dump() for k, v in artifacts.items()},
        "max_branch_lipschitz": max_branch,
        "wall_s": outcome.wall_s,
    }
    method = ("trained contractive L2 Transformer: each residual branch scaled to a certified "
              "Lip_2 <= c < 1 (threshold c, upper the largest branch bound), hence invertible; "
              if cert.attention == "contractive_l2" else
              f"trained {cert.attention} Transformer: no residual branch is scaled to a "
              "constant < 1, so no invertibility certificate; ") + cert.method
    signed = issue(session, runtime, model.id, training_body(
        certificate_id_for_job(job_id), model_sha, cert.seq_len, cert.c, max_branch, method,
        training_section))
    session.flush()
    return result_from_certificate(signed.model_dump(mode="json"), model.id, outcome.wall_s)


def result_from_certificate(body: dict[str, Any], model_id: str,
                            wall_s: float | None = None) -> dict[str, Any]:
    """The job result, rebuilt from a stored training certificate (also after a re-run):
    the signed JSON body is the record, so this reads it, not a library object."""
    t = body["training"]
    recon = t.get("reconstruction") or {}
    return TrainingResult(
        model_id=model_id, certificate_id=body["id"],
        certificate_url=f"/certificates/{body['id']}", artifacts=t["artifacts"],
        invertible=bool(body["passed"]), c=float(t["c"]),
        max_branch_lipschitz=_finite(t.get("max_branch_lipschitz")),
        trunk_lipschitz_upper=_finite(t.get("trunk_lipschitz_upper")),
        reconstruction_max_error=_finite(recon.get("max_error")),
        test_bpc=_finite(t.get("test_bpc")), valid_bpc=_finite(t.get("valid_bpc")),
        steps=int(t.get("steps") or 0), device=str(t.get("device", "")),
        tokens_per_s=_finite(t.get("tokens_per_s")) or 0.0,
        wall_s=float(wall_s if wall_s is not None else t.get("wall_s") or 0.0),
    ).model_dump(mode="json")


__all__ = ["InvalidCorpus", "certificate_id_for_job", "check_corpus_fits",
           "check_training_limits", "find_artifact", "find_corpus", "store_corpus",
           "result_from_certificate", "store_outcome", "training_configs"]
