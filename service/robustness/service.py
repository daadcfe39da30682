"""Robustness certificates (`POST /certify` with `at`, `label`, `min_radius`) as the rest of
the service does long work: the radii (certified by bisection, attack by PGD: tens of seconds
on a Transformer) are computed by a `robustness` job on the `bound` queue, stored once per
(model sha256, centre sha256, label, norm) in `robustness_results`, and signed against each
request's `min_radius`. A request whose radii are stored gets its certificate at once (201);
otherwise a job (202, poll GET /jobs/{id}: its result is the certificate).

Bad input is refused before anything is queued (422 naming the field): the input's shape
against the graph, the label against the model's outputs (one float64 forward pass on the
compute pool).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

import numpy as np
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api_schemas.certificates import Certificate, Counterexamples
from api_schemas.jobs import JobAccepted

from ..bounds.local import model_center, run_counted
from ..bounds.service import load_model
from ..certificates.service import certified_accuracy_body, issue, robustness_body, stored
from ..db import transaction
from ..errors import InvalidRequest, NotFound, PayloadTooLarge
from ..jobs.runner import submit_keyed_job
from ..models.service import ModelRef
from ..runtime import Runtime
from ..tables import RobustnessResultRow, RobustnessSetResultRow
from .verdicts import inputs_sha256

MEMORY_PREFIX = "robustness:"
SET_MEMORY_PREFIX = "robustness-set:"


def radii_key(model_sha256: str, center_sha256: str, label: int, norm: str,
              time_budget: float | None = None) -> str:
    """What the radii depend on (the computation is deterministic and seeded; a time budget
    may stop it earlier: radii under one are stored apart, those without keep the key they
    had before budgets)."""
    fields: dict[str, Any] = {"kind": "robustness", "model": model_sha256,
                              "center_sha256": center_sha256, "label": int(label),
                              "norm": norm}
    if time_budget is not None:
        fields["time_budget_s"] = float(time_budget)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def certificate_key(radii: str, min_radius: float) -> str:
    """The key of one certificate request: identical requests share one active job."""
    return hashlib.sha256(f"{radii}:{float(min_radius)!r}".encode()).hexdigest()


# the tables of stored results (one row per request_key)
ResultRow = TypeVar("ResultRow", RobustnessResultRow, RobustnessSetResultRow)


def _stored_result(runtime: Runtime, table: type[ResultRow], prefix: str,
                   key: str) -> dict[str, Any] | None:
    """The stored result of `key` in `table` (memory, else the database), or None."""
    cached = runtime.reports.get(prefix + key)
    if isinstance(cached, bytes):
        return dict(json.loads(cached))
    with transaction(runtime.read_sessions) as s:
        row = s.scalar(select(table).where(table.request_key == key))
        result = None if row is None else dict(row.result)
    if result is not None:
        remember(runtime, prefix + key, result)
    return result


def remember(runtime: Runtime, key: str, result: dict[str, Any]) -> None:
    """`result` in the memory cache, less its counterexamples (up to the inputs' size each:
    the cache holds thousands of entries; they are read from the database when asked for)."""
    small = {k: v for k, v in result.items() if k != "counterexamples"}
    runtime.reports.put(key, json.dumps(small).encode())


def _insert_once(session: Session, row: ResultRow) -> dict[str, Any]:
    """Insert once; a concurrent job that stored first wins (its result is the same: the
    computation is deterministic and seeded)."""
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        table = type(row)
        existing = session.scalar(select(table).where(table.request_key == row.request_key))
        if existing is None:
            raise
        return dict(existing.result)
    return dict(row.result)


def stored_radii(runtime: Runtime, key: str) -> dict[str, Any] | None:
    """The stored radii of `key`, or None."""
    return _stored_result(runtime, RobustnessResultRow, MEMORY_PREFIX, key)


def store_radii(session: Session, model: ModelRef, key: str,
                radii: dict[str, Any]) -> dict[str, Any]:
    """Insert once; a concurrent job that stored first wins (the radii are the same)."""
    return _insert_once(session, RobustnessResultRow(
        model_id=model.id, request_key=key, norm=str(radii["norm"]), label=int(radii["label"]),
        center_sha256=str(radii["center_sha256"]),
        certified_radius=float(radii["certified_radius"]), result=radii))


def issue_robustness_certificate(runtime: Runtime, model: ModelRef, radii: dict[str, Any],
                                 n: int, min_radius: float,
                                 cert_id: str | None = None) -> Certificate:
    """The robustness certificate of `radii` against `min_radius`, issued in one short write
    transaction (with `cert_id`, a job's: one stored under it first, by an earlier attempt of
    the job presumed dead that finished anyway, is the one returned)."""
    if radii.get("model_sha256") != model.sha256:
        raise ValueError(f"the radii are for model {radii.get('model_sha256')}, not "
                         f"{model.sha256}")
    body = robustness_body(radii, n, min_radius, cert_id=cert_id)
    with transaction(runtime.sessions) as s:
        return issue(s, runtime, model.id, body)


def check_label(runtime: Runtime, model: ModelRef, x0: np.ndarray, label: int) -> str:
    """The centre's sha256 as the engine computes it, after checking `x0` against the graph
    and `label` against the model's outputs; InvalidRequest naming the field otherwise."""
    import torch  # deferred: seconds at start-up

    from lsa_models.engine.drivers.centre import center_sha256, check_center
    from lsa_models.engine.routes.certify import GraphAt, as_onnx

    loaded = load_model(runtime, model)
    try:
        om = as_onnx(loaded, x0.shape[-2])
        x = check_center(om, x0)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"at: {exc}") from None
    with torch.no_grad():
        k = int(GraphAt(om)(torch.from_numpy(x)).numel())
    if not 0 <= label < k:
        raise InvalidRequest(f"label must be in 0..{k - 1} (the model has {k} outputs), got "
                             f"{label}")
    return center_sha256(x)


def submit_robustness_job(runtime: Runtime, model: ModelRef, params: dict[str, Any],
                          kind: str = "robustness") -> JobAccepted:
    """The active job of this exact request, or a new one (one short write transaction)."""
    job_id, status = submit_keyed_job(runtime, kind, params, model_id=model.id)
    return JobAccepted.model_validate({"job_id": job_id, "status": status})


async def robustness_certificate(runtime: Runtime, model: ModelRef, at: list[Any],
                                 label: int, norm: str, min_radius: float,
                                 time_budget: float | None = None
                                 ) -> Certificate | JobAccepted:
    """The certificate now when the radii of (model, centre, label, norm, time budget) are
    stored, else the job that computes them (under the budget: seconds, None for none) and
    then signs it."""
    x0 = await model_center(runtime, model, at)
    raw = hashlib.sha256(np.ascontiguousarray(x0, dtype="<f8").tobytes()).hexdigest()
    sha = await run_counted(runtime, f"robustness-check:{model.sha256}:{raw}:{label}",
                            lambda: check_label(runtime, model, x0, label))
    assert isinstance(sha, str)
    key = radii_key(model.sha256, sha, label, norm, time_budget)
    n = int(x0.shape[-2])
    radii = await run_in_threadpool(stored_radii, runtime, key)
    if radii is not None:
        return await run_in_threadpool(issue_robustness_certificate, runtime, model, radii,
                                       n, min_radius)
    return await run_in_threadpool(
        submit_robustness_job, runtime, model,
        {"model_id": model.id, "norm": norm, "label": label, "at": x0.tolist(),
         "seq_len": n, "min_radius": min_radius, "radii_key": key,
         "request_key": certificate_key(key, min_radius), "time_budget_s": time_budget})


# ---- certified accuracy of a set: POST /certify with inputs, labels, min_radius,
# min_certified_accuracy (a `robustness_set` job; lsa_models.engine.routes.at_radius)
# ---------------


async def set_inputs(runtime: Runtime, model: ModelRef, inputs: list[Any]) -> np.ndarray:
    """The inputs as the graph takes them, stacked (each checked as `at` is: 413 past
    LSA_MAX_AT_ELEMENTS in all, 422 naming the input)."""
    limit = runtime.settings.max_at_elements
    xs = np.asarray(inputs, dtype=np.float64)
    if xs.size > limit:
        raise PayloadTooLarge(f"inputs: {xs.size} numbers (shape {tuple(xs.shape)}), above "
                              f"LSA_MAX_AT_ELEMENTS={limit}: send fewer inputs or raise the "
                              "limit")
    out = []
    for i, x in enumerate(inputs):
        try:
            out.append(await model_center(runtime, model, x))
        except InvalidRequest as exc:
            raise InvalidRequest(f"inputs[{i}]: {str(exc).removeprefix('at: ')}") from None
    return np.stack(out)


def set_result_key(model_sha256: str, inputs_digest: str, norm: str, radius: float,
                   sweep: bool = True, time_budget: float | None = None) -> str:
    """What a set's verdicts depend on (deterministic and seeded; each input's time budget,
    which may stop it earlier), not the threshold."""
    fields: dict[str, Any] = {"kind": "robustness_set", "model": model_sha256,
                              "inputs": inputs_digest, "norm": norm, "radius": float(radius)}
    if not sweep:
        fields["sweep"] = False
    if time_budget is not None:
        fields["time_budget_s"] = float(time_budget)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def stored_set(runtime: Runtime, key: str) -> dict[str, Any] | None:
    """The stored verdicts of `key` (service.robustness.verdicts.set_json's object), or None."""
    return _stored_result(runtime, RobustnessSetResultRow, SET_MEMORY_PREFIX, key)


def store_set(session: Session, model: ModelRef, key: str, digest: str,
              out: dict[str, Any]) -> dict[str, Any]:
    """Insert once; a concurrent job that stored first wins (the verdicts are the same)."""
    return _insert_once(session, RobustnessSetResultRow(
        model_id=model.id, request_key=key, norm=str(out["norm"]), radius=float(out["radius"]),
        n=int(out["n"]), inputs_sha256=digest,
        certified_accuracy=float(out["certified_accuracy"]), result=out))


def issue_set_certificate(runtime: Runtime, model: ModelRef, out: dict[str, Any], n: int,
                          min_radius: float, min_accuracy: float, digest: str,
                          cert_id: str | None = None) -> Certificate:
    """Sign stored verdicts against `min_accuracy` with the server's key and store the
    certificate (with `cert_id`, a job's: one stored under it first is returned)."""
    if out.get("model_sha256") != model.sha256:
        raise ValueError(f"the verdicts are for model {out.get('model_sha256')}, not "
                         f"{model.sha256}")
    body = certified_accuracy_body(out, n, min_radius, min_accuracy, digest, cert_id=cert_id)
    with transaction(runtime.sessions) as s:
        return issue(s, runtime, model.id, body)


async def robustness_set_certificate(runtime: Runtime, model: ModelRef, inputs: list[Any],
                                     labels: list[int], norm: str, min_radius: float,
                                     min_accuracy: float, *, sweep: bool = True,
                                     time_budget: float | None = None
                                     ) -> Certificate | JobAccepted:
    """The certificate now when the verdicts of (model, inputs, labels, norm, radius, time
    budget) are stored (another threshold, or the same request after its job ended), else
    the job that decides every input at min_radius, each within the budget (seconds; None:
    none), and signs it (identical requests share one active job)."""
    xs = await set_inputs(runtime, model, inputs)
    raw = inputs_sha256(xs, labels)
    top = max(labels)
    await run_counted(runtime, f"robustness-check:{model.sha256}:{raw}:{top}",
                      lambda: check_label(runtime, model, xs[0], top))
    result_key = set_result_key(model.sha256, raw, norm, min_radius, sweep, time_budget)
    n = int(xs.shape[-2])
    out = await run_in_threadpool(stored_set, runtime, result_key)
    if out is not None:
        return await run_in_threadpool(issue_set_certificate, runtime, model, out, n,
                                       min_radius, min_accuracy, raw)
    key = hashlib.sha256(f"{result_key}:{float(min_accuracy)!r}".encode()).hexdigest()
    params = {"model_id": model.id, "norm": norm, "inputs": xs.tolist(),
              "labels": [int(v) for v in labels], "seq_len": n,
              "min_radius": min_radius, "min_certified_accuracy": min_accuracy,
              "inputs_sha256": raw, "result_key": result_key, "request_key": key,
              "sweep": sweep, "time_budget_s": time_budget}
    return await run_in_threadpool(submit_robustness_job, runtime, model, params,
                                   "robustness_set")


def counterexamples(runtime: Runtime, certificate_id: str) -> Counterexamples:
    """The counterexamples behind a stored certified-accuracy certificate, read in one
    read-only transaction (one connection per request: a second would exhaust the pool
    under load); NotFound for no such certificate, another kind, or verdicts no longer
    stored."""
    with transaction(runtime.read_sessions) as s:
        return set_counterexamples(s, stored(s, certificate_id))


def set_counterexamples(session: Session, cert: Certificate) -> Counterexamples:
    """The counterexamples stored with the verdicts `cert` was signed from, read in the
    caller's transaction; NotFound for another kind of certificate or verdicts no longer
    stored."""
    rs = cert.robustness_set
    if rs is None:
        raise NotFound(f"certificate {cert.id} is not a certified-accuracy certificate "
                       "(POST /certify with inputs): it has no counterexamples")
    budget = rs.get("time_budget_s")
    key = set_result_key(cert.model_sha256, str(rs["inputs_sha256"]), cert.norm,
                         float(rs["radius"]), rs.get("sweep") is not False,
                         None if budget is None else float(budget))
    row = session.scalar(select(RobustnessSetResultRow).where(
        RobustnessSetResultRow.request_key == key))
    out = None if row is None else row.result
    if out is None or "counterexamples" not in out:
        raise NotFound(f"the verdicts behind certificate {cert.id} are not stored (their "
                       "model was deleted?): certify the set again")
    return Counterexamples(certificate_id=cert.id, norm=cert.norm, radius=float(rs["radius"]),
                           counterexamples=out["counterexamples"])
