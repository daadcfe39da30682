"""The project speaks of the product, not of its making: no tracked file names a work
session by number, as "this" one, or as the one whose machine or measurement a figure came
from. Database sessions share the word and are not matched: the pattern needs a number, "this"
before it, or the machine or a measurement after it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match its own pattern.
_WORD = "sess" + "ion"
WORK_LOG = re.compile(
    rf"\b{_WORD}s? [0-9]+|this {_WORD}|{_WORD}'?s? (machine|measur)", re.IGNORECASE)


def work_log_lines(paths: list[Path], root: Path) -> list[str]:
    """`file:line: text` for every line of the text files among `paths` that the pattern
    matches, files named relative to `root`; binary files (checkpoints) are skipped."""
    found = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if WORK_LOG.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked files to read")
    return [REPO / name for name in listed.decode().split("\0") if name]


def test_no_tracked_file_narrates_work_sessions() -> None:
    found = work_log_lines(tracked_files(), REPO)
    assert not found, "work-log language in tracked files:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    f"measured in {_WORD} 11", f"{_WORD}s 3 and 4", f"This {_WORD}'s run",
    f"on the {_WORD}'s machine", f"{_WORD} measured 0.4", f"the {_WORD}s measure",
    f"({_WORD.upper()} 7)",
])
def test_the_pattern_finds_work_log_lines(line: str, tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text(f"first line\n  {line}\nlast line\n", encoding="utf-8")
    (tmp_path / "weights.bin").write_bytes(b"\xff\xfe\x00" + line.encode())
    paths = [tmp_path / "notes.md", tmp_path / "weights.bin", tmp_path / "missing.md"]
    assert work_log_lines(paths, tmp_path) == [f"notes.md:2: {line}"]


@pytest.mark.parametrize("line", [
    "with Session(engine) as session:", "a database session per request",
    "sessionmaker(bind=engine)", "pytest's session-scoped fixture", "the sessions table",
    "session.commit()  # 2 rows",
])
def test_database_sessions_are_not_work_log(line: str) -> None:
    assert not WORK_LOG.search(line), line
