"""The `lsa` command line, registered here, the one place that imports the domains' command
modules: a domain's commands are plain functions in its package (`service.bounds.cli`,
`service.robustness.cli`, `service.certify.cli_certify` and `cli_verify`), registered on
`common.app` by `_load`; the service's own (db, keys, serve, worker) and `supports` live here
and register themselves when imported. No domain imports this package: what their commands
share is service.kit.

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

# command -> the module that holds it, and for a domain's command the function that is it
# (registered by `_load`); None: the module registers itself
COMMANDS: dict[str, tuple[str, str | None]] = {
    "bound": ("service.bounds.cli", "bound"),
    "certify": ("service.certify.cli_certify", "certify"),
    "db": (f"{__name__}.db", None),
    "keys": (f"{__name__}.keys", None),
    "robustness": ("service.robustness.cli", "robustness_cmd"),
    "serve": (f"{__name__}.serve", None),
    "supports": (f"{__name__}.supports", None),
    "verify": ("service.certify.cli_verify", "verify"),
    "worker": (f"{__name__}.worker", None),
}
COMMAND_NAMES = tuple(COMMANDS)
_registered: set[str] = set()


def _load(names: tuple[str, ...]) -> tuple[ModuleType, ...]:
    """Import each command's module and register a domain's command once (in `names`' order,
    the order `lsa --help` lists them in)."""
    from .common import app

    modules = []
    for name in names:
        module_name, function = COMMANDS[name]
        module = importlib.import_module(module_name)
        if function is not None and name not in _registered:
            app.command(name)(getattr(module, function))
            _registered.add(name)
        modules.append(module)
    return tuple(modules)


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
