"""Compare two golden records (record.py) item by item: every certified number identical,
tighter or looser (upper bounds: smaller is tighter; certified radii: larger is tighter), every
verdict kept or lost, every number on the right side of its float64 bound, and the corpus'
seconds before and after. Writes bench/out/golden/compare-<A>-<B>.json and .png (per item, how
much looser or tighter B is than A) and exits 1 on any looser number, lost verdict or number
past its float64 bound (2 on bad input).

    .venv/bin/python -m bench.golden.compare bench/out/golden/base.json bench/out/golden/head.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

OUTCOMES = ("identical", "tighter", "looser")


def _num(v: Any) -> float | None:
    return None if v is None else float(v)


def number_outcome(kind: str, a: float | None, b: float | None, rtol: float = 0.0) -> str:
    """identical / tighter / looser / lost / gained / none for one certified number (a before,
    b after; None: no number)."""
    if a is None and b is None:
        return "none"
    if b is None:
        return "lost"
    if a is None:
        return "gained"
    if a == b or abs(a - b) <= rtol * max(abs(a), abs(b)):
        return "identical"
    better = b < a if kind == "upper" else b > a
    return "tighter" if better else "looser"


def ratio(kind: str, a: float | None, b: float | None) -> float | None:
    """How much looser B is than A (> 1 looser, < 1 tighter)."""
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return b / a if kind == "upper" else a / b


def unsound(it: dict[str, Any]) -> str | None:
    """Why the item's number is past its float64 bound, or None."""
    v = _num(it.get("value"))
    if v is None:
        return None
    if it["kind"] == "upper" and it.get("lower") is not None and v < it["lower"]:
        return f"upper {v!r} below the float64 lower bound {it['lower']!r}"
    if it["kind"] == "radius" and it.get("upper") is not None and v > it["upper"]:
        return f"certified radius {v!r} above the attack radius {it['upper']!r}"
    return None


def _set_changes(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int, int, list[str]]:
    """(kept, gained, lost, contradictions) over the inputs of one set item."""
    kept = gained = lost = 0
    bad = []
    va, vb = a.get("verdicts") or [], b.get("verdicts") or []
    for i in range(max(len(va), len(vb))):
        sa = va[i]["status"] if i < len(va) else None
        sb = vb[i]["status"] if i < len(vb) else None
        if sa == "certified" and sb != "certified":
            lost += 1
        elif sb == "certified" and sa != "certified":
            gained += 1
            if sa in ("attacked", "misclassified"):
                bad.append(f"input {i}: certified after, {sa} before")
        else:
            kept += 1
    return kept, gained, lost, bad


def compare(a_doc: dict[str, Any], b_doc: dict[str, Any], rtol: float = 0.0) -> dict[str, Any]:
    a_items = {it["id"]: it for it in a_doc["items"]}
    b_items = {it["id"]: it for it in b_doc["items"]}
    counts: Counter[str] = Counter()
    by_task: dict[str, Counter[str]] = {}
    rows, problems = [], []
    sets = Counter[str]()
    for key, a in a_items.items():
        b = b_items.get(key)
        if b is None:
            counts["missing"] += 1
            problems.append(f"{key}: missing after")
            continue
        if a.get("model_sha256") != b.get("model_sha256"):
            counts["different_model"] += 1
            problems.append(f"{key}: the model bytes differ (not comparable)")
            continue
        why = unsound(b)
        if why:
            counts["unsound"] += 1
            problems.append(f"{key}: {why}")
        if a["kind"] == "set":
            kept, gained, lost, bad = _set_changes(a, b)
            sets.update(kept=kept, gained=gained, lost=lost, contradictions=len(bad))
            problems += [f"{key}: {m}" for m in bad]
            if lost:
                problems.append(f"{key}: {lost} certified verdict(s) lost")
            rows.append({"id": key, "task": "set", "outcome": "lost" if lost else
                         ("gained" if gained else "identical"), "a": a.get("value"),
                         "b": b.get("value")})
            continue
        out = number_outcome(a["kind"], _num(a.get("value")), _num(b.get("value")), rtol)
        counts[out] += 1
        by_task.setdefault(a["task"], Counter())[out] += 1
        if a.get("verdict") == "certified" and b.get("verdict") != "certified":
            counts["verdict_lost"] += 1
            problems.append(f"{key}: verdict {a.get('verdict')} -> {b.get('verdict')}"
                            + (f" ({b['error']})" if b.get("error") else ""))
        elif a.get("verdict") != b.get("verdict"):
            counts["verdict_changed"] += 1
            problems.append(f"{key}: verdict {a.get('verdict')} -> {b.get('verdict')}")
        if out in ("looser", "lost"):
            problems.append(f"{key}: {out}: {a.get('value')!r} -> {b.get('value')!r}")
        rows.append({"id": key, "task": a["task"], "kind": a["kind"], "outcome": out,
                     "a": a.get("value"), "b": b.get("value"),
                     "ratio": ratio(a["kind"], _num(a.get("value")), _num(b.get("value")))})
    extra = sorted(set(b_items) - set(a_items))

    def seconds(doc: dict[str, Any]) -> dict[str, Any]:
        per: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for it in doc["items"]:
            per[it["task"]] = per.get(it["task"], 0.0) + (it.get("seconds") or 0.0)
            cpu[it["task"]] = cpu.get(it["task"], 0.0) + (it.get("cpu_seconds") or 0.0)
        return {"wall": doc.get("wall_seconds"), "cpu": doc.get("cpu_seconds"),
                "engine_wall": sum(per.values()), "engine_cpu": sum(cpu.values()),
                "engine_cpu_by_task": dict(cpu), "engine_wall_by_task": dict(per)}

    failed = counts["looser"] + counts["lost"] + counts["unsound"] + counts["verdict_lost"] \
        + counts["missing"] + counts["different_model"] + sets["lost"] + sets["contradictions"]
    return {"a": a_doc.get("label"), "b": b_doc.get("label"),
            "a_revision": a_doc.get("revision"), "b_revision": b_doc.get("revision"),
            "numbers": {k: counts[k] for k in (*OUTCOMES, "lost", "gained", "none")},
            "by_task": {t: dict(c) for t, c in by_task.items()},
            "verdicts_lost": counts["verdict_lost"], "verdicts_changed": counts["verdict_changed"],
            "unsound": counts["unsound"], "missing": counts["missing"],
            "different_model": counts["different_model"], "extra_items": extra,
            "set_verdicts": {k: sets[k] for k in ("kept", "gained", "lost", "contradictions")},
            "seconds": {"a": seconds(a_doc), "b": seconds(b_doc)},
            "failed": failed, "problems": problems, "rows": rows}


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(min(14.0, 0.05 * len(rows) + 5), 4))
    colours = {"global": "tab:blue", "local": "tab:green", "radius": "tab:orange"}
    for task, c in colours.items():
        xs = [i for i, r in enumerate(rows) if r["task"] == task]
        ax.scatter(xs, [rows[i]["ratio"] - 1 for i in xs], s=10, color=c, label=task)
    ax.axhline(0.0, color="gray", lw=0.8)
    # relative changes from one ulp (1e-16) to orders of magnitude on one axis
    ax.set_yscale("symlog", linthresh=1e-16)
    ax.set_xlabel("corpus item")
    ax.set_ylabel(f"{res['b']} / {res['a']} looseness - 1 (> 0: looser)")
    n = res["numbers"]
    ax.set_title(f"{res['a']} -> {res['b']}: identical {n['identical']}, tighter {n['tighter']},"
                 f" looser {n['looser']}, lost {n['lost']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(res: dict[str, Any]) -> str:
    n, s = res["numbers"], res["seconds"]
    lines = [f"{res['a']} -> {res['b']}",
             "certified numbers: " + ", ".join(f"{k} {v}" for k, v in n.items()),
             f"by task: {res['by_task']}",
             (f"verdicts lost {res['verdicts_lost']}, changed {res['verdicts_changed']}; "
              f"set verdicts {res['set_verdicts']}; unsound {res['unsound']}; missing "
              f"{res['missing']}; different model bytes {res['different_model']}")]
    for side in ("a", "b"):
        x = s[side]
        wall, cpu = x["wall"] or math.nan, x["cpu"] or math.nan
        lines.append(f"seconds {res[side]}: whole corpus {wall:.1f} wall / {cpu:.1f} cpu; "
                     f"engine calls {x['engine_wall']:.1f} wall / {x['engine_cpu']:.1f} cpu "
                     f"{ {k: round(v, 1) for k, v in x['engine_cpu_by_task'].items()} }")
    lines += [f"  {p}" for p in res["problems"][:50]]
    lines.append("FAIL" if res["failed"] else "OK")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="the record before (e.g. base.json)")
    ap.add_argument("b", type=Path, help="the record after (e.g. head.json)")
    ap.add_argument("--rtol", type=float, default=0.0,
                    help="relative difference still counted identical (default 0: bit-equal)")
    ap.add_argument("--out", type=Path, default=None, help="folder of the JSON and PNG")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    try:
        a_doc, b_doc = (json.loads(p.read_text()) for p in (args.a, args.b))
        res = compare(a_doc, b_doc, args.rtol)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: cannot compare {args.a} and {args.b}: {exc}", file=sys.stderr)
        return 2
    out = args.out or args.b.parent
    out.mkdir(parents=True, exist_ok=True)
    stem = f"compare-{res['a']}-{res['b']}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_plot:
        plot(res, out / f"{stem}.png")
    print(report(res))
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
