"""The `lsa` command line. Each command group lives in its own module and registers on
`common.app` when imported: a domain's commands in its package (`service.bounds.cli`,
`service.robustness.cli`, `service.certificates.cli_certify` and `cli_verify`), the service's
own (db, keys, serve, worker) and `supports` here.

`lsa COMMAND ...` imports only that command's module: the others pull in SQLAlchemy, Alembic,
FastAPI, uvicorn, httpx, ... (~1.5 s of a `lsa bound` run; bench/gpt2_bound.py). Anything
else (`lsa`, `lsa --help`, an unknown command) and `from service.cli import app` /
`COMMAND_MODULES` import every command module first, so the app is complete there.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

# command -> the module that registers it
COMMANDS = {
    "bound": "service.bounds.cli",
    "certify": "service.certificates.cli_certify",
    "db": f"{__name__}.db",
    "keys": f"{__name__}.keys",
    "robustness": "service.robustness.cli",
    "serve": f"{__name__}.serve",
    "supports": f"{__name__}.supports",
    "verify": "service.certificates.cli_verify",
    "worker": f"{__name__}.worker",
}
COMMAND_NAMES = tuple(COMMANDS)


def _load(names: tuple[str, ...]) -> tuple[ModuleType, ...]:
    return tuple(importlib.import_module(COMMANDS[n]) for n in names)


def full_app() -> typer.Typer:
    """The Typer app with every command registered."""
    _load(COMMAND_NAMES)
    from .common import app

    return app


def __getattr__(name: str) -> Any:  # PEP 562: the complete app only when asked for
    if name == "app":
        return full_app()
    if name == "COMMAND_MODULES":
        return _load(COMMAND_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command in COMMAND_NAMES:
        _load((command,))
        from .common import app
    else:
        app = full_app()
    app()
