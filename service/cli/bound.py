"""`lsa bound PATH`: the certified bound of a model file, as a table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from api_schemas import BoundReport

from . import app
from .common import fail, set_threads

NormOpt = Annotated[str, typer.Option("--norm", help="Input/output norm: 2 (Frobenius) or inf")]


def compute_report(path: Path, norm: str, seq_len: int | None,
                   radius: float | None) -> BoundReport:
    """Load a model file and certify it; raises on bad input (callers turn that into exit 2)."""
    from lsa_models.analysis import load_model_bytes
    from service.reports import bound_report

    if norm not in ("2", "inf"):
        raise ValueError(f"--norm must be 2 or inf, got {norm!r}")
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    data = path.read_bytes()
    loaded = load_model_bytes(data, path.name)
    result = loaded.certify(norm, seq_len, radius)  # type: ignore[arg-type]
    return bound_report(result, loaded.sha256)


def render_table(report: BoundReport, console: Console) -> None:
    table = Table(title=f"Lipschitz bound ({report.norm}-norm, N={report.seq_len})")
    table.add_column("layer")
    table.add_column("kind")
    table.add_column("upper", justify="right")
    table.add_column("status")
    for lb in report.layers:
        table.add_row(lb.name, lb.kind, "-" if lb.upper is None else f"{lb.upper:.6g}",
                      lb.status)
    console.print(table)
    if report.verdict == "certified":
        console.print(f"[bold green]certified[/]: Lip <= {report.upper:.6g}")
    elif report.verdict == "not_lipschitz":
        console.print(f"[bold red]not Lipschitz[/] on an unbounded domain: {report.reason}")
    else:
        console.print(f"[bold yellow]not certified[/]: {report.reason}")
    if report.lower is not None:
        console.print(f"empirical lower bound: {report.lower:.6g}"
                      + (f" (upper/lower = {report.ratio:.3g})" if report.ratio else ""))


@app.command()
def bound(
    path: Annotated[Path, typer.Argument(help="Model file: native .safetensors or .onnx/.zip")],
    norm: NormOpt = "2",
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Sequence length N")] = None,
    radius: Annotated[float | None, typer.Option(
        "--radius", help="Bound every input token's 2-norm by R (bounded domain)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Certify an upper bound on a model's Lipschitz constant."""
    set_threads()
    try:
        report = compute_report(path, norm, seq_len, radius)
    except (ValueError, TypeError, OSError) as exc:
        fail(str(exc))
    if json_out:
        typer.echo(report.model_dump_json())
    else:
        render_table(report, Console())
