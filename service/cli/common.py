"""The `lsa` Typer app: service.cli registers each domain's commands on it, and its own
(db, keys, serve, supports, worker) register themselves when imported."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="lsa",
    help="Certified Lipschitz bounds for self-attention models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Certified Lipschitz bounds for self-attention models."""
