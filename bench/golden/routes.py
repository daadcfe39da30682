"""Per certification route, over a golden record (record.py): how often it gives the winning
number, how often it wins by more than WIN_MARGIN over the best other route, how often it is
the only route with a number, and its share of the seconds (the routes: the tables of
lsa_models/engine/routes/table.py). Local constants: the smallest route number wins (global,
enclosure, adjoint, tangent); certified radii: the largest (affine, affine-quad, affine-eig,
sweep, sweep-adjoint); set verdicts: the route `decide` names as certifying. Ties go to the
route called first (the cheaper one, in the engine's order). Optional routes the engine
skipped and the recorder ran directly ("forced") count as "would win" where they beat the
engine's number. Writes bench/out/golden/routes-<label>.json
and .png and prints the table.

    .venv/bin/python -m bench.golden.routes bench/out/golden/base.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

WIN_MARGIN = 0.01
NOT_ROUTES = ("attack",)  # recorded for its seconds; it certifies nothing
# `decide`'s names of its certifying stages, as the recorder names the calls ("sweep": either
# of its two passes)
DECIDE_NAMES = {"affine (second order)": "affine-quad", "affine (eigenvalues)": "affine-eig"}


def _winner(calls: list[dict[str, Any]], smaller: bool) -> tuple[str, float, float] | None:
    """(route, value, margin over the best other route) among calls with a number."""
    floor = 0.0 if smaller else 1e-300  # a radius of 0 certifies nothing
    vals = [(c["route"], c["value"]) for c in calls
            if c.get("value") is not None and c["value"] >= floor]
    if not vals:
        return None
    best = min(v for _, v in vals) if smaller else max(v for _, v in vals)
    route = next(r for r, v in vals if v == best)
    others = [v for r, v in vals if r != route]
    if not others:
        return route, best, float("inf")
    second = min(others) if smaller else max(others)
    margin = (second / best - 1) if smaller else (best / second - 1)
    return route, best, margin


def _row() -> dict[str, Any]:
    return {"items": 0, "calls": 0, "wins": 0, "wins_over_margin": 0, "sole": 0,
            "would_win_forced": 0, "forced_calls": 0, "seconds": 0.0, "cpu_seconds": 0.0,
            "forced_cpu_seconds": 0.0}


def _account(table: dict[tuple[str, str], dict[str, Any]], task: str,
             calls: list[dict[str, Any]]) -> None:
    """Adds one item's calls to the table: calls, seconds, items (forced apart)."""
    seen = set()
    for c in calls:
        row = table[(task, c["route"])]
        if c.get("forced"):
            row["forced_calls"] += 1
            row["forced_cpu_seconds"] += c.get("cpu_seconds", 0.0)
            continue
        row["calls"] += 1
        row["seconds"] += c.get("seconds", 0.0)
        row["cpu_seconds"] += c.get("cpu_seconds", 0.0)
        if c["route"] not in seen:
            row["items"] += 1
            seen.add(c["route"])


def _score(table: dict[tuple[str, str], dict[str, Any]], it: dict[str, Any],
           mismatched: list[str]) -> None:
    """Credits the item's winning route (and forced routes that would have won)."""
    task = it["task"]
    if task == "set":
        for v in it.get("verdicts", []):
            by = v.get("certified_by")
            if by:
                table[(task, DECIDE_NAMES.get(by, by))]["wins"] += 1
        return
    calls = [c for c in it.get("routes", []) if c["route"] not in NOT_ROUTES]
    w = _winner([c for c in calls if not c.get("forced")], smaller=task == "local")
    if w is None:
        return
    route, best, margin = w
    value = it.get("value")
    if value is not None and best != value:
        mismatched.append(f"{it['id']}: best route {route} {best!r}, engine {value!r}")
    row = table[(task, route)]
    row["wins"] += 1
    row["wins_over_margin"] += margin > WIN_MARGIN
    row["sole"] += margin == float("inf")
    for c in calls:
        v = c.get("value")
        if c.get("forced") and v is not None and value is not None and \
                (v < value if task == "local" else v > value):
            table[(task, c["route"])]["would_win_forced"] += 1


def routes(doc: dict[str, Any]) -> dict[str, Any]:
    table: dict[tuple[str, str], dict[str, Any]] = defaultdict(_row)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "cpu": 0.0,
                                                               "items": 0})
    mismatched: list[str] = []
    for it in doc["items"]:
        if it["task"] == "global" or it.get("error"):
            continue
        tot = totals[it["task"]]
        tot["seconds"] += it.get("seconds") or 0.0
        tot["cpu"] += it.get("cpu_seconds") or 0.0
        tot["items"] += 1
        _account(table, it["task"], it.get("routes", []))
        _score(table, it, mismatched)
    rows = []
    for (task, route), r in sorted(table.items()):
        tot = totals[task]
        r.update(task=task, route=route,
                 share_seconds=r["seconds"] / tot["seconds"] if tot["seconds"] else 0.0,
                 share_cpu=r["cpu_seconds"] / tot["cpu"] if tot["cpu"] else 0.0)
        rows.append(r)
    never = [f"{r['task']}/{r['route']}" for r in rows
             if r["route"] not in NOT_ROUTES and r["calls"] and not r["wins"]]
    small = [f"{r['task']}/{r['route']}" for r in rows
             if r["route"] not in NOT_ROUTES and r["wins"] and not r["wins_over_margin"]
             and r["task"] != "set"]
    return {"label": doc.get("label"), "revision": doc.get("revision"), "margin": WIN_MARGIN,
            "totals": totals, "rows": rows, "never_win": never,
            "win_by_under_margin_only": small, "mismatched": mismatched}


def table_text(res: dict[str, Any]) -> str:
    head = (f"{'task':7s} {'route':14s} {'items':>5s} {'calls':>5s} {'wins':>5s} "
            f"{'>1%':>5s} {'sole':>5s} {'forced':>6s} {'would':>5s} {'cpu s':>8s} {'share':>6s}")
    lines = [head]
    for r in res["rows"]:
        lines.append(f"{r['task']:7s} {r['route']:14s} {r['items']:5d} {r['calls']:5d} "
                     f"{r['wins']:5d} {r['wins_over_margin']:5d} {r['sole']:5d} "
                     f"{r['forced_calls']:6d} {r['would_win_forced']:5d} "
                     f"{r['cpu_seconds']:8.1f} {r['share_cpu']:6.1%}")
    lines.append(f"never win: {res['never_win']}")
    lines.append(f"win only by <= {res['margin']:.0%}: {res['win_by_under_margin_only']}")
    if res["mismatched"]:
        lines.append(f"engine number not a route's ({len(res['mismatched'])}): "
                     + "; ".join(res["mismatched"][:5]))
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r["calls"]]
    names = [f"{r['task']}/{r['route']}" for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.3 * len(rows) + 1.5), sharey=True)
    y = range(len(rows))
    a1.barh(y, [r["wins"] for r in rows], color="tab:blue", label="wins")
    a1.barh(y, [r["wins_over_margin"] for r in rows], color="tab:orange",
            label=f"wins by > {res['margin']:.0%}")
    a1.set_yticks(list(y), names, fontsize=7)
    a1.set_xlabel("items")
    a1.legend(fontsize=7)
    a2.barh(y, [100 * r["share_cpu"] for r in rows], color="tab:gray")
    a2.set_xlabel("share of the task's cpu seconds (%)")
    fig.suptitle(f"routes over the golden corpus ({res['label']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    try:
        res = routes(json.loads(args.record.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: cannot read {args.record}: {exc}", file=sys.stderr)
        return 2
    out = args.out or args.record.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / f"routes-{res['label']}.json").write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_plot:
        plot(res, out / f"routes-{res['label']}.png")
    print(table_text(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
