"""The `lsa` command line. Each command group lives in its own module and registers on
`common.app` when imported here."""

from __future__ import annotations

from . import bound, certify, db, keys, robustness, serve, supports, verify, worker
from .common import app

COMMAND_MODULES = (bound, certify, db, keys, robustness, serve, supports, verify, worker)


def main() -> None:
    app()
