"""`lsa robustness MODEL --at X0.npy --label Y`: certified and attack radii; and the local
(ball) report of `lsa bound --at X0.npy --eps E`, which shares its input handling."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console

from api_schemas import BoundReport

from ..local import local_report_of, model_input, robustness_of
from .common import app, fail, set_threads


def load_center(path: Path) -> np.ndarray:
    """X0 from a .npy file (no pickles: object arrays are refused)."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (--at takes a .npy file holding one input)")
    try:
        x = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a readable .npy array ({exc}); write it with "
                         "numpy.save") from None
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{path}: the array has dtype {x.dtype}; a float array is needed")
    return np.asarray(x, dtype=np.float64)


def check_eps(eps: float | None) -> float:
    if eps is None:
        raise ValueError("--at needs --eps E: the radius of the ball around the input")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"--eps must be finite and >= 0, got {eps}")
    return eps


def load_model(path: Path) -> Any:
    # Deferred here and below: lsa_models imports torch (seconds; `lsa --help` needs none).
    from lsa_models.analysis import load_model_bytes

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    return load_model_bytes(path.read_bytes(), path.name)


def local_report(path: Path, norm: str, at: Path, eps: float | None, *,
                 empirical: Any = None) -> BoundReport:
    """The bound on the ball {X : ||X - X0||_norm <= eps}; `upper` is the local constant.
    With `empirical` (EmpiricalOptions), the in-ball projected-ascent lower bound too."""
    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    e = check_eps(eps)
    x0 = load_center(at)
    loaded = load_model(path)
    x0 = model_input(loaded, x0, field="--at")
    return local_report_of(loaded, loaded.sha256, x0, e, norm, empirical=empirical)


def robustness_json(path: Path, at: Path, label: int, norm: str) -> dict[str, Any]:
    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    x0 = load_center(at)
    loaded = load_model(path)
    return robustness_of(loaded, loaded.sha256, model_input(loaded, x0, field="--at"), label,
                         norm)


@app.command("robustness")
def robustness_cmd(
    path: Annotated[Path, typer.Argument(help="Model file: .onnx/.zip or native .safetensors")],
    at: Annotated[Path, typer.Option("--at", help="The input: .npy of shape (N, D) or "
                                     "(1, N, D); on a pixel upload the image (C, H, W) or "
                                     "(1, C, H, W)")],
    label: Annotated[int, typer.Option("--label", help="The class whose margins must stay "
                                       "positive")],
    norm: Annotated[str, typer.Option("--norm", help="Perturbation norm: 2 (Frobenius) or "
                                      "inf")] = "2",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Certified robustness radius of a label around an input (every margin f_Y - f_j stays
    positive on the ball), beside the smallest label flip PGD finds."""
    set_threads()
    try:
        out = robustness_json(path, at, label, norm)
    except (ValueError, TypeError, OSError) as exc:
        fail(str(exc))
    if json_out:
        typer.echo(json.dumps(out))
        return
    c = Console()
    c.print(f"label {out['label']} (predicted {out['predicted']}), {norm}-norm")
    c.print(f"certified_radius: {out['certified_radius']:.6g} (by the {out['certified_by']} "
            "route)")
    att = out["attack_radius"]
    c.print("attack_radius: " + ("none found" if att is None else f"{att:.6g}"))
    c.print("margins: " + ", ".join(f"{j}: {m:.4g}" for j, m in out["margins"].items()))
    c.print(f"seconds: certify {out['seconds']['certify']:.2f}, attack "
            f"{out['seconds']['attack']:.2f}")
