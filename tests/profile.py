"""The example count of a property test whose examples are costly.

tests/conftest.py loads one hypothesis profile (`fast` for `make test`, `full` for `make
test-all`) before any test module is imported, and the profile sets every property test's
example count. A test whose single example builds, exports or searches a model caps it with
`at_most`, next to a comment saying what an example costs: the cap holds at the full count
and the fast profile still lowers it."""

from __future__ import annotations

from hypothesis import settings


def at_most(cap: int) -> int:
    """The loaded profile's `max_examples`, at most `cap`."""
    return min(cap, settings().max_examples)
