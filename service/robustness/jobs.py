"""The `robustness` job (queue `bound`): the certified radius (the affine walks, then the radius
sweep; its progress names each step: "radius sweep 7/30, certified 0.041") and the PGD attack
radius, within the request's time budget, stored once per (model, centre, label, norm,
budget); then the certificate against the request's min_radius, signed with the server's
key. The job's result is that certificate.

A re-run after a crash finds what its first run stored: the certificate (its id is derived
from the job id) or at least the radii. A job whose radii an earlier running job (another
min_radius) is computing waits for them instead of computing them twice."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from ..bounds.service import load_model
from ..jobs.context import JobContext
from ..jobs.registry import JobKind, register_job_kind
from ..models.service import ModelRef
from ..runtime import Runtime
from ..tables import CertificateRow, Job, UploadedModel
from .service import (
    MEMORY_PREFIX,
    SET_MEMORY_PREFIX,
    issue_robustness_certificate,
    issue_set_certificate,
    remember,
    store_radii,
    store_set,
    stored_radii,
    stored_set,
)
from .verdicts import robustness_of, verdicts_of

CERT_NAMESPACE = uuid.UUID("3f7c2a9e-5b61-4f0e-9a2d-6c1e8b4d7a55")
SEARCH_SHARE = 0.9  # of the job's progress; the loading and the signature take the rest
WAIT_POLL_S = 0.5  # between looks at the radii another job is computing


class RobustnessJobParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str
    norm: str
    label: int = Field(ge=0)
    at: list[Any]  # the input the graph takes (a pixel upload's image already cut)
    seq_len: int
    min_radius: float = Field(gt=0)
    radii_key: str
    request_key: str
    # seconds (None: none; jobs queued before budgets had none)
    time_budget_s: float | None = Field(default=None, gt=0)


def certificate_id_for_job(job_id: str) -> str:
    return str(uuid.uuid5(CERT_NAMESPACE, job_id))


def computing_before(ctx: JobContext, kind: str, field: str, key: str) -> str | None:
    """A job of `kind` whose params' `field` is `key` (the same radii or verdicts, another
    threshold) that started running before this one, or None. Only earlier ones: two jobs
    never wait for each other."""
    with ctx.session() as s:
        me = s.get(Job, ctx.job_id)
        mine = (me.started_at, me.id) if me is not None and me.started_at else None
        rows = s.execute(select(Job.id, Job.started_at, Job.params).where(
            Job.kind == kind, Job.status == "running", Job.id != ctx.job_id)).all()
    for job_id, started, params in rows:
        if (params or {}).get(field) == key and started is not None \
                and (mine is None or (started, job_id) < mine):
            return str(job_id)
    return None


def wait_for_result(ctx: JobContext, kind: str, field: str, key: str,
                    stored: Callable[[Runtime, str], dict[str, Any] | None],
                    what: str) -> dict[str, Any] | None:
    """The stored result; while an earlier running job computes it, wait for it rather than
    compute it twice (its end, or its requeue after a crash, stops the wait)."""
    while True:
        result = stored(ctx.runtime, key)
        other = None if result is not None else computing_before(ctx, kind, field, key)
        if other is None:
            return result
        # The write is also this job's heartbeat and cancel check.
        ctx.progress(0.05, f"waiting for job {other}, which computes the same {what}")
        time.sleep(WAIT_POLL_S)


def _stored_certificate(ctx: JobContext, cert_id: str) -> dict[str, Any] | None:
    """The certificate an earlier attempt of this job stored, or None."""
    with ctx.session() as s:
        done = s.get(CertificateRow, cert_id)
        return None if done is None else dict(done.body)


def _model_of(ctx: JobContext, model_id: str) -> ModelRef:
    with ctx.session() as s:
        row = s.get(UploadedModel, model_id)
        if row is None:
            raise ValueError(f"model {model_id} no longer exists")
        return ModelRef.of(row)


def check_signing_key(ctx: JobContext) -> None:
    key_path = Path(ctx.runtime.settings.signing_key_path)
    if not key_path.is_file():
        # A worker must sign with the server's key (GET /certificates/public-key).
        raise ValueError(f"the signing key LSA_SIGNING_KEY_PATH={key_path} does not exist on "
                         "this worker: share the server's key file with its workers")


def run_robustness(ctx: JobContext) -> dict[str, Any]:
    p = RobustnessJobParams.model_validate(ctx.params)
    cert_id = certificate_id_for_job(ctx.job_id)
    done = _stored_certificate(ctx, cert_id)
    if done is not None:
        return done
    model = _model_of(ctx, p.model_id)
    check_signing_key(ctx)
    radii = wait_for_result(ctx, "robustness", "radii_key", p.radii_key, stored_radii, "radii")
    if radii is None:
        ctx.progress(0.02, "loading model", force=True)
        loaded = load_model(ctx.runtime, model)
        ctx.progress(0.05, "searching the certified radius", force=True)

        def progress(stage: str, fraction: float) -> None:
            # Each step's write is also the cancel check (JobAborted stops the search).
            ctx.progress(0.05 + SEARCH_SHARE * float(fraction), stage, force=True)

        radii = robustness_of(loaded, model.sha256, np.asarray(p.at, dtype=np.float64),
                              p.label, p.norm, progress=progress, time_budget=p.time_budget_s)
        ctx.progress(0.96, "storing the radii", force=True)
        with ctx.session() as s:
            radii = store_radii(s, model, p.radii_key, radii)
        ctx.runtime.reports.put(MEMORY_PREFIX + p.radii_key, json.dumps(radii).encode())
    ctx.progress(0.98, "signing the certificate", force=True)
    cert = issue_robustness_certificate(ctx.runtime, model, radii, p.seq_len, p.min_radius,
                                        cert_id=cert_id)
    return cert.model_dump(mode="json")


register_job_kind(JobKind("robustness", queue="bound", handler=run_robustness,
                          params_schema=RobustnessJobParams))


class RobustnessSetJobParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str
    norm: str
    inputs: list[Any]  # stacked as the graph takes them (pixel uploads' images already cut)
    labels: list[int]
    seq_len: int
    min_radius: float = Field(gt=0)
    min_certified_accuracy: float = Field(ge=0, le=1)
    inputs_sha256: str
    result_key: str
    request_key: str
    sweep: bool = True
    time_budget_s: float | None = Field(default=None, gt=0)  # each input's (None: none)


def run_robustness_set(ctx: JobContext) -> dict[str, Any]:
    """Every input decided at min_radius (lsa_models.engine.routes.at_radius; progress: "k/n inputs
    decided", in any order), each within the time budget (an input it stopped is unknown,
    its reason saying so), stored once per (model, inputs, labels, norm, radius, budget), then the
    certified-accuracy certificate, signed and stored (its id derived from the job's: a
    re-run after a crash returns the one stored). A job whose verdicts an earlier running job
    (another threshold) is deciding waits for them."""
    p = RobustnessSetJobParams.model_validate(ctx.params)
    cert_id = certificate_id_for_job(ctx.job_id)
    done = _stored_certificate(ctx, cert_id)
    if done is not None:
        return done
    model = _model_of(ctx, p.model_id)
    check_signing_key(ctx)
    out = wait_for_result(ctx, "robustness_set", "result_key", p.result_key, stored_set,
                          "verdicts")
    if out is None:
        ctx.progress(0.02, "loading model", force=True)
        loaded = load_model(ctx.runtime, model)

        def decided(k: int, n: int) -> None:
            # as the inputs finish, in any order (a slow first input does not hide the
            # others'); each write is also the cancel check
            ctx.progress(0.05 + 0.9 * k / n, f"{k}/{n} inputs decided", force=True)

        out = verdicts_of(loaded, model.sha256, np.asarray(p.inputs, dtype=np.float64),
                          np.asarray(p.labels, dtype=np.int64), p.norm, p.min_radius,
                          decided=decided, sweep=p.sweep, counterexamples=True,
                          workers=ctx.runtime.settings.set_processes,
                          time_budget=p.time_budget_s)
        ctx.progress(0.96, "storing the verdicts", force=True)
        with ctx.session() as s:
            out = store_set(s, model, p.result_key, p.inputs_sha256, out)
        remember(ctx.runtime, SET_MEMORY_PREFIX + p.result_key, out)
    ctx.progress(0.98, "signing the certificate", force=True)
    cert = issue_set_certificate(ctx.runtime, model, out, p.seq_len, p.min_radius,
                                 p.min_certified_accuracy, p.inputs_sha256, cert_id)
    return cert.model_dump(mode="json")


register_job_kind(JobKind("robustness_set", queue="bound", handler=run_robustness_set,
                          params_schema=RobustnessSetJobParams))
