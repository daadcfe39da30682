"""Where a certified radius loses: for one classifier, norm and radius, each margin's lower
bound from the affine forms split into what produced it, op by op. A margin's form is
`centre + o + l . d + sum_q a_q e_q + [-b, b]`; its lower bound spends `eps ||l||_dual` on
the input's linear part (first order: the attack pays it too) and `sum |a_q|` on the error
symbols, each made by one op of the walk (a GELU's chord, a product's cross terms, a
LayerNorm's rsqrt, ...). The table sums `|a_q|` per op that made the symbol, for the plain
output form and, where the head reads one token (docs/local-affine.md, "One token's margin by
its sign"), for the signed form too; with --quad the second-order symbols' part is sized as
the margins size it alone (Frobenius on the 2-ball, l1 on the inf-ball). Diagnostic only: the
certified radius itself comes from `lsa_models.engine.routes.certify.robustness`.

    .venv/bin/python bench/margin_losses.py tf1 --norm 2 --radius 0.342 [--quad]
    .venv/bin/python bench/margin_losses.py hf-vit --norm inf --radius 0.04

Models: the classifiers of bench/local_models.py (mlp, tf1, tf2) and the library
classifiers of bench/robustness_zoo.py. Writes bench/out/margin_losses.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lsa_models.engine.affine import form as affine  # noqa: E402
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.affine.form import Aff  # noqa: E402
from lsa_models.engine.drivers import jacobian as driver
from lsa_models.engine.drivers import jacobian_walk
from lsa_models.engine.heads import final_layernorm as deferred
from lsa_models.engine.values import Ball, dual_row_norms  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def _load(name: str, tmp: Path) -> tuple[Any, np.ndarray]:
    """(the ONNX model, its centre input) as the benches build them."""
    if name in ("mlp", "tf1", "tf2"):
        from local_models import build, center, export

        om = load_onnx(export(build(name, 0), tmp / f"{name}.onnx").read_bytes())
        return om, center(1).numpy().astype(np.float64)
    import robustness_zoo as zoo

    return zoo.load(name, tmp)


@contextmanager
def _recorded() -> Iterator[tuple[list[tuple[int, int, str]], list[tuple[Aff, float]]]]:
    """Records the symbol columns each top-level op of a walk creates ([first, end) past the
    input's P, the op) and the one-token signed forms (deferred.signed_margin's g, value)."""
    created: list[tuple[int, int, str]] = []
    signed: list[tuple[Aff, float]] = []
    step, wsum, smargin = affine_rules.step, deferred.weighted_sum, deferred.signed_margin
    depth = [0]
    last: list[Aff] = []

    def spy_step(node, *a, **k):  # type: ignore[no-untyped-def]
        sp = affine.SPACE.get()
        before = sp[1] if sp else 0
        depth[0] += 1
        try:
            out = step(node, *a, **k)
        finally:
            depth[0] -= 1
        sp = affine.SPACE.get()
        after = sp[1] if sp else 0
        if after > before and depth[0] == 0:
            created.append((before, after, f"{node.op_type} {node.name}"))
        return out

    def spy_wsum(x, w, ball):  # type: ignore[no-untyped-def]
        out = wsum(x, w, ball)
        last.append(out)
        return out

    def spy_signed(*a, **k):  # type: ignore[no-untyped-def]
        v = smargin(*a, **k)
        if v is not None and last:
            signed.append((last[-1], v))
        return v
    affine_rules.step = spy_step  # type: ignore[assignment]
    deferred.weighted_sum = spy_wsum  # type: ignore[assignment]
    deferred.signed_margin = spy_signed  # type: ignore[assignment]
    try:
        yield created, signed
    finally:
        affine_rules.step = step  # type: ignore[assignment]
        deferred.weighted_sum = wsum  # type: ignore[assignment]
        deferred.signed_margin = smargin  # type: ignore[assignment]


def _split(a: np.ndarray, ball: Ball, created: list[tuple[int, int, str]], top: int,
           quad: bool) -> dict[str, Any]:
    """One margin's coefficient row a (P + symbols,): its input part and symbols per op."""
    p = ball.size
    by: dict[str, float] = defaultdict(float)
    for s, e, name in created:
        by[name] += float(np.abs(a[p + s:p + e]).sum())
    q = affine.quad_size(p) if quad else 0
    second = 0.0
    if q and a.size > p:  # the second-order symbols' part, as the margins size it alone
        cq = affine._cols(a[None], p + q)[0, p:p + q]
        second = float(affine.quad_two(cq[None], p)[0]) if ball.norm == "2" else \
            float(np.abs(cq).sum())
    return dict(input=ball.eps * float(dual_row_norms(np.abs(a[:p])[None], ball.norm)[0]),
                second_order=second, symbols=float(np.abs(a[p + q:]).sum()),
                ops=dict(sorted(by.items(), key=lambda t: -t[1])[:top]))


def measure(name: str, norm: str, radius: float, quad: bool, top: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        om, x0 = _load(name, Path(tmp))
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f64(torch.from_numpy(x0)).reshape(-1).argmax())
    ball = Ball(x0, radius, norm)
    with _recorded() as (created, signed):
        low = driver.margin_lower_bounds(om, x0, radius, norm, label, quad=quad,
                                         eig=quad and norm == "2")
        walk = list(created)
        # the plain output form, from a walk of its own (the symbols are numbered the same)
        created.clear()
        ctr = driver.Centre(om, x0)
        with ctr:
            chains, inside = jacobian_walk.fused_chains(om, ctr.module, ctr.env)
            forms = affine_rules.walk(list(ctr.module.runtime_nodes), om.spec.input_name,
                                      ctr.env, ball, chains, inside, om.spec.output_name,
                                      quad=quad)
    out = forms.get(om.spec.output_name)
    rows: dict[str, Any] = dict(model=name, norm=norm, radius=radius, quad=quad, label=label,
                                lower_bounds=low, margins={})
    if out is None:
        rows["note"] = "the forms do not reach the output"
        return rows
    a = out.a.reshape(out.c.size, -1)
    c = out.c.reshape(-1)
    for j in range(out.c.size):
        if j == label:
            continue
        row = _split(a[label] - a[j], ball, walk, top, quad)
        row["centre"] = float(c[label] - c[j])
        rows["margins"][j] = dict(plain=row)
    others = [j for j in range(out.c.size) if j != label]
    for j, (g, v) in zip(others, signed, strict=False):
        row = _split(g.a.reshape(-1), ball, walk, top, quad)
        row.update(value=v, g_centre=float(g.c.reshape(-1)[0]))
        rows["margins"][j]["signed"] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--norm", choices=["inf", "2"], default="inf")
    ap.add_argument("--radius", type=float, required=True)
    ap.add_argument("--quad", action="store_true", help="the second-order walks")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    rows = measure(args.model, args.norm, args.radius, args.quad, args.top)
    OUT.mkdir(exist_ok=True)
    (OUT / "margin_losses.json").write_text(json.dumps(rows, indent=2, default=str))
    print(f"{rows['model']} {rows['norm']}-ball radius {rows['radius']}: margin lower bounds "
          f"{rows['lower_bounds']}")
    for j, kinds in rows["margins"].items():
        for kind, row in kinds.items():
            head = f"centre {row['centre']:.4g}" if kind == "plain" else \
                f"value {row['value']:.4g} (g centre {row['g_centre']:.4g})"
            print(f"margin {j} {kind}: {head}, input {row['input']:.4g}, second order "
                  f"{row['second_order']:.4g}, error symbols {row['symbols']:.4g}")
            for op, v in row["ops"].items():
                print(f"    {v:10.4g}  {op}")


if __name__ == "__main__":
    main()
