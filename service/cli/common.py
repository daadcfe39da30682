"""What CLI commands share: the `lsa` Typer app they register on, exit codes, one-line
errors on stderr."""

from __future__ import annotations

import sys
from typing import NoReturn

import typer
from pydantic import ValidationError

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

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """One line on stderr, then exit; bad input is code 2."""
    print(f"lsa: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise typer.Exit(code)


def settings_error(exc: ValidationError) -> str:
    """A settings validation error as one line naming each LSA_ variable at fault."""
    parts = []
    for err in exc.errors():
        name = "LSA_" + "_".join(str(p) for p in err["loc"]).upper()
        parts.append(f"{name}: {err['msg']}")
    return "bad settings: " + "; ".join(parts)


def set_threads() -> None:
    import torch  # deferred: importing torch takes seconds; only some commands need it

    # Two cores contend badly; one thread is faster and reproducible.
    torch.set_num_threads(1)
