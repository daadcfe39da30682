"""Write docs/results.md from every JSON file the benchmarks left under bench/out/.

    python bench/results_page.py [--out-dir bench/out] [--page docs/results.md]

The header names the machine (platform, processor, CPU count), the git commit and the date;
each benchmark file directly under bench/out/ gets a section with its settings and one
markdown table per list of records in it. The benchmarks write different shapes, all handled here:
- a list of records at the top (`[{...}, ...]`) or under a key (`{"rows": [...]}`), also
  nested (`{"models": [{"kind": ..., "local": [...]}]}`: the inner records get the outer
  record's scalar fields as leading columns);
- one flat object (`{"benchmark": ..., "svd_s": ...}`): a two-column table of its fields;
- nested objects inside a record are flattened into dotted columns (`seconds.baseline`);
- short lists of numbers are shown inline, long ones by their length; a string that already
  is a markdown table is copied as it is.
Only the standard library is used (Python 3.11 or later).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MAX_INLINE = 6  # numbers of a list shown inline; longer lists show their length
MAX_CELL = 60  # characters of a string cell
MAX_ROWS = 80  # rows of one table; the rest is counted

Record = dict[str, Any]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lsa_models", "bench"],
                               cwd=ROOT, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        if len(value) <= MAX_INLINE and all(not isinstance(v, (dict, list)) for v in value):
            return ", ".join(_cell(v) for v in value)
        return f"({len(value)} values)"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 3] + "..."


def _flatten(record: Record, prefix: str = "") -> tuple[Record, dict[str, list[Record]]]:
    """The record's scalar fields with nested objects as dotted keys, and its inner lists of
    records by their dotted key."""
    flat: Record = {}
    inner: dict[str, list[Record]] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            sub_flat, sub_inner = _flatten(value, name + ".")
            flat.update(sub_flat)
            inner.update(sub_inner)
        elif _is_records(value):
            inner[name] = value
        else:
            flat[name] = value
    return flat, inner


def _tables(records: list[Record], context: Record | None = None,
            name: str = "") -> list[tuple[str, list[Record]]]:
    """One (title, rows) per list of records, inner lists after their parents, each inner
    row led by its parent's scalar fields."""
    rows: list[Record] = []
    inner_rows: dict[str, list[Record]] = {}
    for record in records:
        flat, inner = _flatten(record)
        rows.append({**(context or {}), **flat})
        for key, sub in inner.items():
            # the parent's own scalar fields (not its nested objects) name the inner rows
            lead = {k: v for k, v in record.items() if not isinstance(v, (dict, list))}
            for title, sub_rows in _tables(sub, {**(context or {}), **lead}, key):
                inner_rows.setdefault(title, []).extend(sub_rows)
    out = [(name, rows)]
    out.extend(inner_rows.items())
    return out


def _markdown_table(rows: list[Record]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |"
              for row in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines += ["", f"({len(rows) - MAX_ROWS} more rows in the JSON file)"]
    return lines


def section(path: Path, data: Any) -> list[str]:
    """The markdown section of one benchmark file."""
    written = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC)
    lines = [f"## {path.stem}", "",
             f"`bench/out/{path.name}`, written {written:%Y-%m-%d %H:%M} UTC"
             + (f"; plot `bench/out/{path.stem}.png`" if path.with_suffix(".png").exists()
                else "") + ".", ""]
    if _is_records(data):
        data = {"records": data}
    if not isinstance(data, dict):
        return lines + [f"A JSON {type(data).__name__}: {_cell(data)}", ""]
    flat, inner = _flatten(data)
    verbatim = {k: v for k, v in flat.items()
                if isinstance(v, str) and v.lstrip().startswith("|") and "\n" in v}
    settings = {k: v for k, v in flat.items() if k not in verbatim}
    if inner:
        if settings:
            lines.append("Settings: " + "; ".join(f"{k} = {_cell(v)}"
                                                  for k, v in settings.items()) + ".")
            lines.append("")
        for key, records in inner.items():
            for title, rows in _tables(records, name=key):
                lines += [f"### {title}", "", *_markdown_table(rows), ""]
    elif settings:
        lines += ["| field | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in settings.items()]
        lines.append("")
    for text in verbatim.values():
        lines += [text.strip(), ""]
    return lines


def page(out_dir: Path) -> str:
    # the top level only: bench/out/alirpa/ holds a virtual environment and a source tree
    files = sorted(p for p in out_dir.glob("*.json") if p.is_file()) if out_dir.is_dir() else []
    now = dt.datetime.now(dt.UTC)
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python bench/results_page.py` from the JSON files under `bench/out/`;",
        "do not edit by hand. Each section is one benchmark's last run; its script's docstring",
        "says what it measures (`bench/<name>.py`).",
        "",
        f"- Machine: {platform.platform()}; {_cpu_model()}; {os.cpu_count()} CPUs",
        f"- Commit: {_git_commit()}",
        f"- Date: {now:%Y-%m-%d %H:%M} UTC",
        "",
    ]
    if not files:
        lines += ["No benchmark output under `bench/out/` yet: run a script from `bench/`.", ""]
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            lines += [f"## {path.stem}", "", f"Not readable as JSON: {exc}.", ""]
            continue
        lines += section(path, data)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "results.md")
    args = parser.parse_args()
    args.page.write_text(page(args.out_dir))
    print(f"wrote {args.page}")


if __name__ == "__main__":
    main()
