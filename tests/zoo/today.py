"""What lsa says today about the zoo cases whose right verdict it does not reach.

Keyed by (model, layout, exporter); each is an `xfail(strict=True)` case of the zoo test,
so a case lsa learns to read fails until its entry here is removed. Generated from a zoo
run (bench/out/zoo.json), then edited by hand."""

from __future__ import annotations

# Empty: every zoo case gets its right verdict.
TODAY: dict[tuple[str, str, str], str] = {}
