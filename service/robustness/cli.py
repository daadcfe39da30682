"""`lsa robustness MODEL --at X0.npy --label Y`: certified and attack radii (with --radius,
the verdict at one radius; with --inputs, a set's: cli_set.py). Its input handling is
service/kit/inputs.py, shared with `lsa bound --at` and `lsa verify --recompute`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from api_schemas.requests import (
    DEFAULT_DECIDE_BUDGET_S,
    DEFAULT_RADIUS_BUDGET_S,
    MAX_TIME_BUDGET_S,
)

from ..bounds.local import model_input
from ..certificates.service import certified_accuracy
from ..kit.console import EXIT_FAILED, fail, set_threads
from ..kit.gate_reports import counterexamples_npz, set_message, write_file
from ..kit.inputs import check_radius, load_center, load_model
from ..settings import default_set_workers
from .cli_set import (
    certificate_set,
    print_certificate,
    print_set,
    set_progress,
    set_reports,
    sign_set_here,
    verdicts_json,
    verdicts_server,
)
from .verdicts import robustness_of


def time_budget_of(text: str | None, mode: str) -> float | None:
    """--time-budget as seconds (None: no budget): a number > 0, or `none`; absent, the
    default of the mode (DEFAULT_RADIUS_BUDGET_S for the radius search, else
    DEFAULT_DECIDE_BUDGET_S per input). ValueError naming the option otherwise."""
    if text is None:
        return DEFAULT_RADIUS_BUDGET_S if mode == "one" else DEFAULT_DECIDE_BUDGET_S
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIME_BUDGET_S):
        raise ValueError(f"--time-budget must be a number of seconds > 0 and at most "
                         f"{MAX_TIME_BUDGET_S:g}, or none (no budget), got {text!r}")
    return value


def robustness_json(path: Path, at: Path, label: int, norm: str,
                    time_budget: float | None = None) -> dict[str, Any]:
    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    x0 = load_center(at)
    loaded = load_model(path)
    return robustness_of(loaded, loaded.sha256, model_input(loaded, x0, field="--at"), label,
                         norm, time_budget=time_budget)


def verdict_one_json(path: Path, at: Path, label: int, norm: str, radius: float,
                     flips: list[Any] | None = None,
                     time_budget: float | None = None) -> dict[str, Any]:
    from lsa_models.engine.routes.at_radius import decide

    from ..bounds.local import model_image
    from .verdicts import verdict_json

    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    r = check_radius(radius)
    x0 = load_center(at)
    loaded = load_model(path)
    v = decide(loaded, model_input(loaded, x0, field="--at"), label, norm, r,
               time_budget=time_budget)
    if flips is not None and v.flip is not None:
        flips.append((0, v.label, v.flip_class, v.flip_distance,
                      model_image(loaded, v.flip).reshape(x0.shape)))
    return {"model_sha256": loaded.sha256, "norm": norm, "radius": r,
            "time_budget_s": time_budget, **verdict_json(v)}


def _print_radius(out: dict[str, Any]) -> None:
    c = Console(soft_wrap=True)  # CI logs: one line per fact, not wrapped at 80
    c.print(f"label {out['label']} (predicted {out['predicted']}), {out['norm']}-norm, radius "
            f"{out['radius']:.6g}: {out['status']}"
            + (f" (by the {out['certified_by']} route)" if out["certified_by"] else "")
            + (f", label flipped to {out['flip_class']} at distance "
               f"{out['flip_distance']:.6g}" if out["status"] == "attacked" else "")
            + (f" ({out['reason']})" if out.get("reason") else ""))


def robustness_cmd(
    path: Annotated[Path, typer.Argument(help="Model file: .onnx/.zip or native .safetensors")],
    at: Annotated[Path | None, typer.Option("--at", help="The input: .npy of shape (N, D) or "
                                            "(1, N, D); on a pixel upload the image (C, H, "
                                            "W) or (1, C, H, W)")] = None,
    label: Annotated[int | None, typer.Option("--label", help="The class whose margins must "
                                              "stay positive")] = None,
    inputs: Annotated[Path | None, typer.Option("--inputs", help="Several inputs: .npy, "
                                                "stacked along a first axis, (S, N, D) (pixel "
                                                "uploads: (S, C, H, W)); needs --labels and "
                                                "--radius")] = None,
    labels: Annotated[Path | None, typer.Option("--labels", help=".npy of S integer labels, "
                                                "one per input")] = None,
    radius: Annotated[float | None, typer.Option("--radius", help="Decide at this radius "
                                                 "(certified / attacked / unknown / "
                                                 "misclassified) instead of searching the "
                                                 "largest certified one")] = None,
    min_certified_accuracy: Annotated[float | None, typer.Option(
        "--min-certified-accuracy", help="With --inputs: exit 1 unless at least this "
        "fraction of the inputs is certified at the radius (a CI gate)")] = None,
    norm: Annotated[str, typer.Option("--norm", help="Perturbation norm: 2 (Frobenius) or "
                                      "inf")] = "2",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    server: Annotated[str | None, typer.Option(
        "--server", help="With --inputs: an lsa server URL that decides the inputs and signs "
        "a certified-accuracy certificate (needs --min-certified-accuracy); --json prints "
        "the certificate")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LSA_API_KEY", help="API key for --server")] = None,
    junit: Annotated[Path | None, typer.Option(
        "--junit", help="With --inputs: write JUnit XML (the gate and one case per input; "
        "inputs not certified are skipped, with their verdict)")] = None,
    summary: Annotated[Path | None, typer.Option(
        "--summary", help="With --inputs: append a Markdown summary (e.g. "
        "$GITHUB_STEP_SUMMARY)")] = None,
    counterexamples: Annotated[Path | None, typer.Option(
        "--counterexamples", help="With --radius: write the label flips PGD found as a .npz "
        "(index, label, flip_class, distance, inputs in the given layout; with --server, "
        "the server's)")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="With --inputs (locally): decide the inputs in this many processes "
        "(the verdicts are the same) [default: the CPUs this process may use, at most 4]",
        min=1)] = None,
    certificate: Annotated[Path | None, typer.Option(
        "--certificate", help="With --min-certified-accuracy: write the signed "
        "certified-accuracy certificate (the server's with --server, else signed here with "
        "--key); `lsa verify` checks it")] = None,
    key: Annotated[Path | None, typer.Option(
        "--key", help="Local signing key for --certificate (Ed25519 PEM, created if missing); "
        "default: LSA_SIGNING_KEY_PATH or ./var/signing_key.pem")] = None,
    sweep: Annotated[bool, typer.Option(
        "--sweep/--no-sweep", help="With --inputs: try the radius sweep on inputs "
        "the affine walks and the attack leave undecided (on attention models most of the "
        "time, rarely a verdict: --no-sweep leaves them unknown, faster)")] = True,
    time_budget: Annotated[str | None, typer.Option(
        "--time-budget", metavar="S", help="Seconds per input, a number > 0 or none (no "
        "budget), looked at between the steps (a step that has started finishes): once "
        "spent, the best proven so far (at a radius: unknown; the radius search: the "
        "largest radius certified in time), marked stopped_by_budget [default: "
        f"{DEFAULT_DECIDE_BUDGET_S:g} per input at a radius, {DEFAULT_RADIUS_BUDGET_S:g} "
        "for the radius search]")] = None,
) -> None:
    """Certified robustness radius of a label around an input (every margin f_Y - f_j stays
    positive on the ball), beside the smallest label flip PGD finds; with --radius, the
    verdict at that radius; with --inputs/--labels/--radius, the verdicts of a set of inputs
    and its certified accuracy (exit 0 passed or no gate, 1 below --min-certified-accuracy, 2
    bad input)."""
    set_threads()
    start = time.monotonic()
    flips: list[Any] | None = None if counterexamples is None else []
    out: dict[str, Any] | None = None
    cert: dict[str, Any] = {}
    mode = "set" if inputs is not None else "one"
    try:
        mode = _mode(at, label, inputs, labels, radius, min_certified_accuracy)
        _check_outputs(mode, server, junit, summary, counterexamples)
        _check_set_options(mode, server, min_certified_accuracy, workers, sweep, certificate,
                           key)
        budget = time_budget_of(time_budget, mode)
        if mode == "set" and server is not None:
            assert inputs is not None and labels is not None and radius is not None
            cert = verdicts_server(path, inputs, labels, norm, radius, min_certified_accuracy,
                                   server, api_key, sweep, flips, budget)
            out = certificate_set(cert)
            if certificate is not None:
                write_file(certificate, json.dumps(cert, indent=2).encode() + b"\n")
        elif mode == "set":
            assert inputs is not None and labels is not None and radius is not None
            out = verdicts_json(path, inputs, labels, norm, radius, progress=set_progress,
                                flips=flips, sweep=sweep,
                                workers=default_set_workers() if workers is None else workers,
                                time_budget=budget)
            gate = min_certified_accuracy
            out["min_certified_accuracy"] = gate
            out["passed"] = None if gate is None else certified_accuracy(
                out["certified_accuracy"], gate)
            if certificate is not None:
                assert gate is not None and radius is not None
                signed = sign_set_here(out, radius, gate, key)
                out["certificate_id"] = signed.id
                write_file(certificate, signed.model_dump_json(indent=2).encode() + b"\n")
        elif mode == "one-radius":
            assert at is not None and label is not None and radius is not None
            out = verdict_one_json(path, at, label, norm, radius, flips=flips,
                                   time_budget=budget)
        else:
            assert at is not None and label is not None
            out = robustness_json(path, at, label, norm, budget)
        if counterexamples is not None and flips is not None:
            write_file(counterexamples, counterexamples_npz(flips))
    except (ValueError, TypeError, OSError) as exc:
        set_reports(path, norm, radius, min_certified_accuracy, None, str(exc),
                     time.monotonic() - start, junit, summary)
        fail(str(exc))
    if mode != "set":
        _print_one(mode, out, json_out)
        return
    assert out is not None
    set_reports(path, norm, radius, min_certified_accuracy, out, set_message(out),
                 time.monotonic() - start, junit, summary)
    if server is not None:
        print_certificate(cert, json_out)
    elif json_out:
        typer.echo(json.dumps(out))
    else:
        print_set(out, min_certified_accuracy)
    if out["passed"] is False:
        raise typer.Exit(EXIT_FAILED)


def _check_outputs(mode: str, server: str | None, junit: Path | None, summary: Path | None,
                   counterexamples: Path | None) -> None:
    """ValueError naming an option that does not go with the mode."""
    if server is not None and mode != "set":
        raise ValueError("--server takes --inputs, --labels, --radius and "
                         "--min-certified-accuracy (a certified-accuracy certificate)")
    if mode != "set" and (junit is not None or summary is not None):
        raise ValueError("--junit and --summary report a gate on a set of inputs: give "
                         "--inputs, --labels and --radius")
    if counterexamples is not None and mode == "one":
        raise ValueError("--counterexamples needs --radius R: the label flips found inside "
                         "the ball of that radius are written")


def _check_set_options(mode: str, server: str | None, gate: float | None, workers: int | None,
                       sweep: bool, certificate: Path | None, key: Path | None) -> None:
    """ValueError naming a set-mode option given outside it (or with what it excludes)."""
    if workers is not None and workers > 1 and (mode != "set" or server is not None):
        raise ValueError("--workers decides a set of inputs here: give --inputs, --labels "
                         "and --radius, without --server")
    if not sweep and mode != "set":
        raise ValueError("--no-sweep is for a set of inputs: give --inputs, --labels and "
                         "--radius")
    if (certificate is not None or key is not None) and (mode != "set" or gate is None):
        raise ValueError("--certificate and --key sign a certified-accuracy certificate: "
                         "give --inputs, --labels, --radius and --min-certified-accuracy")
    if key is not None and server is not None:
        raise ValueError("--key signs here; with --server the server signs with its own "
                         "key: drop --key")


def _print_one(mode: str, out: dict[str, Any] | None, json_out: bool) -> None:
    assert out is not None
    if json_out:
        typer.echo(json.dumps(out))
        return
    if mode == "one-radius":
        _print_radius(out)
        return
    c = Console(soft_wrap=True)  # CI logs: one line per fact, not wrapped at 80
    c.print(f"label {out['label']} (predicted {out['predicted']}), {out['norm']}-norm")
    c.print(f"certified_radius: {out['certified_radius']:.6g} (by the {out['certified_by']} "
            "route)")
    if out.get("stopped_by_budget"):
        c.print(f"stopped by the time budget ({out['time_budget_s']:g} s) before "
                f"{out['stopped_before']}: the largest radius certified in time (sound; a "
                "larger one may hold: --time-budget none searches on)")
    att = out["attack_radius"]
    c.print("attack_radius: " + ("none found" if att is None else f"{att:.6g}"))
    c.print("margins: " + ", ".join(f"{j}: {m:.4g}" for j, m in out["margins"].items()))
    c.print(f"seconds: certify {out['seconds']['certify']:.2f}, attack "
            f"{out['seconds']['attack']:.2f}")


def _mode(at: Path | None, label: int | None, inputs: Path | None, labels: Path | None,
          radius: float | None, gate: float | None) -> str:
    """"one" (the radii of one input), "one-radius" (its verdict at --radius) or "set";
    ValueError naming the options that do not go together."""
    if inputs is not None or labels is not None:
        if at is not None or label is not None:
            raise ValueError("give either --at with --label (one input) or --inputs with "
                             "--labels (several), not both")
        if inputs is None or labels is None:
            raise ValueError("--inputs and --labels go together: the inputs stacked along a "
                             "first axis and one integer label each")
        if radius is None:
            raise ValueError("--inputs needs --radius R: the verdicts are taken at one radius")
        if gate is not None and not (math.isfinite(gate) and 0 <= gate <= 1):
            raise ValueError(f"--min-certified-accuracy must be in [0, 1], got {gate}")
        return "set"
    if gate is not None:
        raise ValueError("--min-certified-accuracy needs --inputs, --labels and --radius")
    if at is None or label is None:
        raise ValueError("give --at X0.npy with --label Y (or --inputs X.npy with --labels "
                         "Y.npy and --radius R)")
    return "one" if radius is None else "one-radius"
