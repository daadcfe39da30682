"""What CLI commands share: exit codes, one-line errors on stderr, the settings' errors and
the local signing key's path."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import typer
from pydantic import ValidationError

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


def local_key_path() -> Path:
    """The service settings' signing key (LSA_SIGNING_KEY_PATH), so a local certificate is
    signed with the same key a server on this machine uses; ValueError naming the setting
    at fault."""
    from ..settings import Settings

    try:
        return Settings().signing_key_path
    except ValidationError as exc:
        raise ValueError(f"settings: {exc.errors()[0]['msg']}") from None
