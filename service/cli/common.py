"""Helpers shared by CLI commands: exit codes and one-line errors on stderr."""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """One line on stderr, then exit; bad input is code 2."""
    print(f"lsa: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise typer.Exit(code)


def set_threads() -> None:
    import torch

    # Two cores contend badly; one thread is faster and reproducible.
    torch.set_num_threads(1)
