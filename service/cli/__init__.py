"""The `lsa` command line. Each command group lives in its own module and registers on `app`."""

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


# Command modules register themselves on import.
from . import bound as _bound  # noqa: E402,F401
from . import certify as _certify  # noqa: E402,F401
from . import db as _db  # noqa: E402,F401
from . import keys as _keys  # noqa: E402,F401
from . import robustness as _robustness  # noqa: E402,F401
from . import serve as _serve  # noqa: E402,F401
from . import verify as _verify  # noqa: E402,F401
from . import worker as _worker  # noqa: E402,F401


def main() -> None:
    app()
