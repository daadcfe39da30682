"""`lsa bound PATH`: the certified bound of a model file, as a table or JSON."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from api_schemas import BoundReport

from ..kit.console import fail, set_threads
from .files import EmpiricalOptions, compute_report, local_report

NormOpt = Annotated[str, typer.Option("--norm", help="Input/output norm: 2 (Frobenius) or inf")]


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[float, str], None] | None]:
    """A rich progress bar on stderr when it is a terminal (JSON on stdout stays clean)."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return

    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("empirical lower bound", total=1.0)

        def update(fraction: float, stage: str) -> None:
            bar.update(task, completed=fraction, description=f"empirical: {stage}")

        yield update


def render_table(report: BoundReport, console: Console) -> None:
    where = "" if report.domain is None else (
        f", ball eps={report.domain.eps:g} around {report.domain.center_sha256[:12]}")
    table = Table(title=f"Lipschitz bound ({report.norm}-norm, N={report.seq_len}{where})")
    table.add_column("layer")
    table.add_column("kind")
    table.add_column("upper", justify="right")
    table.add_column("status")
    table.add_column("rule")
    for lb in report.layers:
        up = "-" if lb.upper is None else f"{lb.upper:.6g}"
        if lb.global_upper is not None and lb.upper is not None:
            up = f"{lb.global_upper:.4g} -> {lb.upper:.4g} locally"
        table.add_row(lb.name, lb.kind, up, lb.status, lb.rule or "")
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
    w = report.witness
    if w is not None and w.seed is not None:
        console.print(f"witness: seed {w.seed}, restarts {w.restarts}, steps {w.steps}"
                      + (f", Theorem 3.1 input at s={w.scale:g}" if w.source == "growth" else ""))
    if w is not None and w.growth:
        pairs = ", ".join(f"{g.scale:g}: {g.jacobian_norm:.4g}" for g in w.growth)
        console.print(f"||J|| along the Theorem 3.1 inputs (s: norm): {pairs}")


def bound(
    path: Annotated[Path, typer.Argument(help="Model file: native .safetensors or .onnx/.zip")],
    norm: NormOpt = "2",
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Sequence length N")] = None,
    radius: Annotated[float | None, typer.Option(
        "--radius", help="Bound every input token's 2-norm by R (bounded domain)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    empirical: Annotated[bool, typer.Option(
        "--empirical", help="Also search an empirical lower bound (adds lower, ratio, witness)")
    ] = False,
    restarts: Annotated[int, typer.Option("--restarts", help="Random restarts (--empirical)")
                        ] = 4,
    steps: Annotated[int, typer.Option("--steps", help="Ascent steps per restart (--empirical)")
                     ] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the search (--empirical)")] = 0,
    time_budget: Annotated[float | None, typer.Option(
        "--time-budget", help="Stop the search after this many seconds (--empirical)")] = None,
    at: Annotated[Path | None, typer.Option(
        "--at", help="Bound locally around this input (.npy of shape (N, D) or (1, N, D); "
        "on a pixel upload the image (C, H, W) or (1, C, H, W))")
    ] = None,
    eps: Annotated[float | None, typer.Option(
        "--eps", help="Radius of the ball around --at, in the --norm norm")] = None,
) -> None:
    """Certify an upper bound on a model's Lipschitz constant (globally, or on the ball of
    radius --eps around the input --at)."""
    set_threads()
    try:
        options = EmpiricalOptions(restarts, steps, seed, time_budget) if empirical else None
        if at is None and eps is not None:
            raise ValueError("--eps needs --at X0.npy: the centre of the ball")
        if at is not None:
            if radius is not None:
                raise ValueError("--radius and --at exclude each other: the ball around "
                                 "--at already bounds the input")
            report = local_report(path, norm, at, eps, empirical=options)
        else:
            with progress_bar(empirical) as progress:
                report = compute_report(path, norm, seq_len, radius, empirical=options,
                                        progress=progress)
    except (ValueError, TypeError, OSError) as exc:
        fail(str(exc))
    if json_out:
        typer.echo(report.model_dump_json())
    else:
        render_table(report, Console())
