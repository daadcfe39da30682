"""`lsa supports [--json]`: what lsa reads (after VNN-LIB 2.0's `supports`): the ONNX
operators and opsets, the attention and normalisation patterns, the input layouts and norms.

Operators and opsets come from the library itself (`lsa_models.onnx.ops`, the loader's opset
range), so the listing cannot drift from the code. Patterns are recognised by what they
compute (lsa_models/onnx/patterns.py, attention.py); their descriptions live here, next to
the certificate each one gets (docs/certification.md, docs/bounds.md).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .common import app

# (pattern, what it covers, what lsa certifies for it)
PATTERNS: tuple[tuple[str, str, str], ...] = (
    ("L2 self-attention, tied", ("logits -c||q_i - q_j||^2 (+ masks, causal), values "
     "X c' W^Q W^Q^T W^V, any number of heads"),
     "Theorem 3.2 bound (times max(1, c' sqrt(d)))"),
    ("L2 self-attention, untied", "logits -c||q_i - k_j||^2 with W^K != W^Q",
     "not_certified (not Lipschitz in general)"),
    ("dot-product self-attention", ("logits c q_i.k_j (+ additive or boolean masks, causal; "
     "masked_fill replacing logits by constants; SDPA's NaN guard when no row is all masked)"),
     ("ball bound when its input norms are bounded (LayerNorm before it, or --radius; with "
     "replaced logits the key bias counts); otherwise not_lipschitz (Theorem 3.1)")),
    ("rotary position embeddings", ("dot-product queries/keys rotated per position (LLaMA's "
     "rotate_half with Cos/Sin tables; a key bias counts as for replaced logits)"),
     "the ball bound with its scale times certified max_i ||R_i|| (1 for exact rotations)"),
    ("sequence-first attention", ("logits (T, S, B, H) with the Softmax over the key axis, "
     "Einsum products (neural_stpp style)"), "as the same attention in the canonical layout"),
    ("SiLU and gated MLPs", "x * Sigmoid(x); a product of two tensors with bounded tokens",
     "1.0999; R_b Lip(a) + R_a Lip(b) (docs/bounds.md, Gated MLPs)"),
    ("LayerNorm", "LayerNormalization, or decomposed ReduceMean/Sub/Pow/Sqrt/Div",
     "max|gamma| / sqrt(eps) (eps > 0), output radius sqrt(D) max|gamma| + ||beta||"),
    ("GELU", "Gelu, or written out with Erf or tanh (GPT-2)", "1.1290"),
    ("residual", "x + f(x)", "1 + Lip(f)"),
)
LAYOUTS: tuple[tuple[str, str], ...] = (
    ("(batch, N, D)", "one float input, batch first"),
    ("(N, D)", "one float input without a batch axis"),
    ("(N, 1, D)", "sequence first (torch's batch_first=False), analysed through transposes"),
    ("pixels (batch, C, H, W)", ("an image: read by one patch-embedding Conv (kernel == stride, "
     "no padding) it is analysed on its patches (batch, P, C kh kw), by anything else (a "
     "Flatten, a CNN's Conv) as one token (batch, 1, C H W); both are the pixels permuted")),
    ("token ids (batch, N)", ("an integer input whose only use is a Gather from a constant "
     "(V, D) table: the map after the embedding lookup is bounded")),
    ("native .safetensors", "lsa_models checkpoints (lsa_models.save)"),
)
NORMS = ("2", "inf")


def _family(op: object) -> tuple[str, str]:
    """(family, its description): the op's module in lsa_models.onnx.ops and its docstring."""
    module = sys.modules[type(op).__module__]
    return module.__name__.rsplit(".", 1)[-1], (module.__doc__ or "").strip().splitlines()[0]


def supports_data() -> dict[str, Any]:
    """The listing as one JSON-ready object."""
    from lsa_models.onnx import OPS, supported_op_types
    from lsa_models.onnx.loading import MAX_OPSET, MIN_OPSET

    ops = []
    families: dict[str, str] = {}
    for name in supported_op_types():
        family, doc = _family(OPS[name])
        families[family] = doc
        ops.append({"op": name, "family": family})
    return {
        "onnx": {"opset_min": MIN_OPSET, "opset_max": MAX_OPSET, "domain": "ai.onnx",
                 "operators": ops, "families": families},
        "patterns": [{"pattern": p, "covers": c, "certificate": r} for p, c, r in PATTERNS],
        "layouts": [{"layout": lay, "meaning": m} for lay, m in LAYOUTS],
        "norms": list(NORMS),
    }


def _render(data: dict[str, Any], console: Console) -> None:
    onnx = data["onnx"]
    console.print(f"ONNX opsets {onnx['opset_min']}..{onnx['opset_max']} (domain ai.onnx)")
    ops = Table(title=f"ONNX operators ({len(onnx['operators'])}), by family")
    for col in ("family", "operators", "what the family covers"):
        ops.add_column(col)
    for family, doc in sorted(onnx["families"].items()):
        members = [o["op"] for o in onnx["operators"] if o["family"] == family]
        ops.add_row(family, ", ".join(members), doc)
    console.print(ops)
    pats = Table(title="Patterns (recognised by what they compute)")
    for col in ("pattern", "covers", "certificate"):
        pats.add_column(col)
    for p in data["patterns"]:
        pats.add_row(p["pattern"], p["covers"], p["certificate"])
    console.print(pats)
    lays = Table(title="Input layouts")
    lays.add_column("layout")
    lays.add_column("meaning")
    for lay in data["layouts"]:
        lays.add_row(lay["layout"], lay["meaning"])
    console.print(lays)
    console.print(f"norms: {', '.join(data['norms'])}; models that lsa reads, with their "
                  "verdicts: docs/supported-models.md")


@app.command()
def supports(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """List the ONNX operators, opsets, patterns and input layouts lsa reads."""
    data = supports_data()
    if json_out:
        typer.echo(json.dumps(data))
    else:
        _render(data, Console())
