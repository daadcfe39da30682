"""`lsa robustness --inputs X --labels Y --radius R`: the verdicts of a set of inputs here or
on a server, its certificate (signed here or by the server), the gate's reports and what it
prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console

from ..bounds.local import model_input
from ..kit.console import fail
from ..kit.gate_reports import append_summary, set_junit_xml, set_summary_markdown, write_file
from ..kit.inputs import check_radius, load_center, load_labels, load_model


def load_set(loaded: Any, inputs: Path, labels: Path
             ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """(the inputs as the graph takes them, stacked: each as given, a pixel upload's image cut
    into its patches, exactly as a server takes them; the labels; the shape the inputs were
    given in). ValueError naming the option or input at fault."""
    xs = load_center(inputs, "--inputs", "the inputs stacked along a first axis")
    ys = load_labels(labels)
    if xs.ndim >= 1 and xs.shape[0] == 0:
        raise ValueError(f"--inputs holds no inputs (shape {tuple(xs.shape)}): give at least "
                         "one input")
    if xs.ndim < 2 or xs.shape[0] != ys.shape[0]:
        raise ValueError(f"--inputs holds shape {tuple(xs.shape)} and --labels {ys.shape[0]} "
                         "labels: give the inputs stacked along a first axis, one label each")
    return np.stack([model_input(loaded, xs[i], field=f"inputs[{i}]")
                     for i in range(xs.shape[0])]), ys, tuple(xs.shape)


def verdicts_json(path: Path, inputs: Path, labels: Path, norm: str, radius: float,
                  progress: Any = None, flips: list[Any] | None = None,
                  workers: int = 1, sweep: bool = True,
                  time_budget: float | None = None) -> dict[str, Any]:
    """The set mode's JSON, with the set's `inputs_sha256` and `seq_len` (what a
    certificate of it names); with `flips`, each attacked input's counterexample is appended
    to it as (index, label, flip class, distance, the point in the layout the input was
    given in)."""
    from .verdicts import decide_set, flips_of, inputs_sha256, set_json

    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    r = check_radius(radius)
    loaded = load_model(path)
    xs, ys, given = load_set(loaded, inputs, labels)
    rep = decide_set(loaded, xs, ys, norm, r, progress=progress, workers=workers,
                     sweep=sweep, time_budget=time_budget)
    if flips is not None:
        flips.extend((c["index"], c["label"], c["flip_class"], c["distance"], c["input"])
                     for c in flips_of(loaded, rep, given[1:]))
    return {**set_json(loaded.sha256, rep), "inputs_sha256": inputs_sha256(xs, ys.tolist()),
            "seq_len": int(xs.shape[-2])}


def print_set(out: dict[str, Any], gate: float | None) -> None:
    c = Console(soft_wrap=True)  # CI logs: one line per fact, not wrapped at 80
    n, k = out["n"], out["counts"]
    c.print(f"{n} inputs, {out['norm']}-norm, radius {out['radius']:.6g}: certified "
            f"{k['certified']}, attacked {k['attacked']}, unknown {k['unknown']}, "
            f"misclassified {k['misclassified']}"
            + (f" ({out['stopped_by_budget']} unknown when the time budget of "
               f"{out['time_budget_s']:g} s per input ran out)" if out.get("stopped_by_budget")
               else ""))
    c.print(f"certified accuracy {out['certified_accuracy']:.4f} <= robust accuracy <= "
            f"{out['attack_accuracy']:.4f} (clean accuracy {out['clean_accuracy']:.4f}); "
            f"{out['seconds']:.1f} s")
    if gate is not None:
        c.print(f"{'passed' if out['passed'] else 'failed'}: certified accuracy "
                f"{'>=' if out['passed'] else '<'} {gate:g}"
                + (f" (certificate {out['certificate_id']}, signed here)"
                   if out.get("certificate_id") else ""))


def verdicts_server(path: Path, inputs: Path, labels: Path, norm: str, radius: float,
                    gate: float | None, server: str, api_key: str | None,
                    sweep: bool = True, flips: list[Any] | None = None,
                    time_budget: float | None = None) -> dict[str, Any]:
    """The certified-accuracy certificate from an lsa server (POST /certify with inputs; the
    server signs it): the model uploaded, the inputs sent as given (a pixel upload's images
    are cut by the server), the job waited for; with `flips`, the server's counterexamples
    (GET /certificates/{id}/counterexamples) appended as the local mode's; `time_budget`:
    each input's on the server (None: none). ValueError for bad input or an unusable
    server."""
    import hashlib

    from ..client import ClientConfig, ClientError, LSAClient

    if gate is None:
        raise ValueError("--server needs --min-certified-accuracy A: the threshold the "
                         "server's certificate is signed against")
    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    r = check_radius(radius)
    xs = load_center(inputs, "--inputs", "the inputs stacked along a first axis")
    ys = load_labels(labels)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    config = ClientConfig(base_url=server, api_key=api_key)

    def progress(stage: str, fraction: float | None) -> None:
        print(f"server: {stage}", file=sys.stderr, flush=True)

    try:
        with LSAClient(config) as client:
            model = client.upload_model(path)
            cert = client.certify_accuracy(model["id"], xs.tolist(), ys.tolist(), r, gate,
                                           norm, progress=progress, sweep=sweep,
                                           time_budget_s=time_budget)
            if flips is not None:
                flips.extend((c.index, c.label, c.flip_class, c.distance,
                              np.asarray(c.input, dtype=np.float64).reshape(xs.shape[1:]))
                             for c in client.counterexamples(cert.id).counterexamples)
    except (ClientError, KeyError) as exc:
        raise ValueError(f"server {server}: {exc}") from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if cert.model_sha256 != digest or cert.robustness_set is None:
        raise ValueError(f"server {server}: the certificate is not a certified-accuracy one "
                         f"for {path} (sha256 {digest})")
    return cert.model_dump(mode="json")


def set_progress(i: int, n: int, v: Any) -> None:
    print(f"input {i + 1}/{n}: {v.status}" + (f" ({v.certified_by})" if v.certified_by else "")
          + (" (stopped by the time budget)" if v.stopped_by_budget else "")
          + f", {v.seconds:.1f} s", file=sys.stderr, flush=True)


def set_reports(path: Path, norm: str, radius: float | None, gate: float | None,
                 out: dict[str, Any] | None, message: str, elapsed_s: float,
                 junit: Path | None, summary: Path | None) -> None:
    """The set gate's JUnit XML and Markdown summary (on an error too, as `lsa certify`'s:
    the CI job shows why it stopped); a report that cannot be written is an error."""
    try:
        if junit is not None:
            write_file(junit, set_junit_xml(path, norm, radius, gate, out, message, elapsed_s))
        if summary is not None:
            append_summary(summary, set_summary_markdown(path, norm, radius, gate, out,
                                                         message))
    except OSError as exc:
        fail(f"cannot write a report: {exc}")


def sign_set_here(out: dict[str, Any], radius: float, gate: float, key_path: Path | None
                  ) -> Any:
    """The certified-accuracy certificate of the set mode's JSON, signed with the local key
    as the server's (service.certificates.service: the same body and the certified_accuracy pass
    rule)."""
    from service.certificates.service import certified_accuracy_body, sign
    from service.signing_key import SigningKeyError, load_or_create_signing_key

    from ..kit.console import local_key_path

    try:
        path = key_path if key_path is not None else local_key_path()
        signing_key = load_or_create_signing_key(path)
    except (SigningKeyError, OSError, ValueError) as exc:
        raise ValueError(f"signing key: {exc}; pass --key FILE (an Ed25519 PEM private key, "
                         "created if missing)") from None
    return sign(certified_accuracy_body(out, int(out["seq_len"]), radius, gate,
                                        out["inputs_sha256"]), signing_key)


def certificate_set(cert: dict[str, Any]) -> dict[str, Any]:
    """A server's certified-accuracy certificate in the set mode's JSON shape (for the
    reports): per input its label and status; no flips or seconds (the certificate keeps
    the verdicts, not how they were reached)."""
    rs = cert["robustness_set"]
    n, k = rs["n"], rs["counts"]
    return {"model_sha256": cert["model_sha256"], "norm": cert["norm"],
            "radius": rs["radius"], "n": n, "counts": k,
            "certified_accuracy": rs["certified_accuracy"],
            "attack_accuracy": rs["attack_accuracy"],
            "clean_accuracy": 1.0 - k["misclassified"] / max(1, n),
            "min_certified_accuracy": cert["threshold"], "passed": cert["passed"],
            "certificate_id": cert["id"], "lsa_version": cert["lsa_version"],
            "samples": [{"index": i, "label": y, "status": st} for i, (y, st)
                        in enumerate(zip(rs["labels"], rs["statuses"], strict=True))]}


def print_certificate(cert: dict[str, Any], json_out: bool) -> None:
    if json_out:
        typer.echo(json.dumps(cert))
        return
    rs = cert["robustness_set"]
    k = rs["counts"]
    c = Console(soft_wrap=True)  # CI logs: one line per fact, not wrapped at 80
    c.print(f"{rs['n']} inputs, {cert['norm']}-norm, radius {rs['radius']:.6g}: certified "
            f"{k['certified']}, attacked {k['attacked']}, unknown {k['unknown']}, "
            f"misclassified {k['misclassified']}")
    c.print(f"{'passed' if cert['passed'] else 'failed'}: certified accuracy "
            f"{rs['certified_accuracy']:.4f} vs {cert['threshold']:g} (certificate "
            f"{cert['id']}, signed by the server)")
