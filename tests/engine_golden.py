"""Bit-identity check of the bound engine: record every global result, compare later.

`python -m tests.engine_golden record OUT.json` bounds a broad set of models (every native
checkpoint under tests/data/, native models built from lsa_models configs of every attention
kind, ONNX exports of the tests' and the zoo's builders), in both norms, with and without an
input radius, at several N, and writes verdict, upper (as the float's hex, exact), reason and
the per-layer list of each. `python -m tests.engine_golden compare OUT.json` recomputes and
lists every difference (exit 1 when there is one). The ONNX exports are written once into
`bench/out/engine_golden/` (git-ignored) and reused, so both runs read the same bytes.

Used to keep a refactoring of the drivers (bounds/analyzer.py, onnx/analyzer.py, the engine
in lsa_models/bounds/layer_graph/) from moving any number: record on the old code, compare on
the new.
tests/test_layer_graph.py runs a small slice of the same cases against each other.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lsa_models.bounds.report import NormName

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / "out" / "engine_golden"
NORMS: tuple[NormName, ...] = ("2", "inf")


def _fx(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def summary(result: Any) -> dict[str, Any]:
    """Everything of a BoundResult a refactoring must not change, floats exact."""
    return {
        "verdict": result.verdict,
        "upper": _fx(result.upper),
        "reason": result.reason,
        "method": result.method,
        "layers": [[lb.name, lb.kind, _fx(lb.upper), lb.status, lb.reason, list(lb.nodes)]
                   for lb in result.layers],
    }


def _native_models() -> Iterator[tuple[str, nn.Module]]:
    from lsa_models import CharTransformerLM, LMConfig, Transformer, TransformerConfig, load
    from lsa_models.invertible import ContractiveTrunk, ContractiveTrunkConfig

    for path in sorted((ROOT / "tests" / "data").rglob("*.safetensors")):
        m = load(path)
        cont = getattr(m, "continuous_part", None)
        yield f"ckpt:{path.name}", cont() if callable(cont) else m
    for att in ("dp", "l2", "l2_untied"):
        for causal in (False, True):
            for norm_first in (True, False):
                for final in (False, True):
                    torch.manual_seed(0)
                    cfg = TransformerConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16,
                                            attention=att, causal=causal, norm_first=norm_first,
                                            final_norm=final,
                                            activation="relu" if causal else "gelu")
                    yield f"tf:{att}:c{int(causal)}:nf{int(norm_first)}:f{int(final)}", \
                        Transformer(cfg).eval()
    lm_kinds: tuple[Any, ...] = ("dp", "l2", "l2_untied", "contractive_l2")
    for att in lm_kinds:
        for act in ("relu", "tanh", "sigmoid"):
            torch.manual_seed(1)
            lm = CharTransformerLM(LMConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2,
                                            d_ff=16, seq_len=6, attention=att, activation=act))
            yield f"lm:{att}:{act}", lm.continuous_part()
    torch.manual_seed(2)
    yield "trunk", ContractiveTrunk(ContractiveTrunkConfig(d_model=8, n_heads=2, n_layers=2,
                                                           d_ff=16, max_len=9)).eval()
    torch.manual_seed(3)
    yield "seq:linear-gelu-ln", nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.1),
                                              nn.LayerNorm(8), nn.Identity(), nn.Linear(8, 4))


def native_results() -> dict[str, Any]:
    from lsa_models.bounds import certify

    out: dict[str, Any] = {}
    for name, model in _native_models():
        for norm in NORMS:
            for n in (1, 4, 9):
                for radius in (None, 0.5, 3.0):
                    key = f"native:{name}:{norm}:N{n}:r{radius}"
                    try:
                        out[key] = summary(certify(model, norm, n, radius))
                    except (TypeError, ValueError) as exc:
                        out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _onnx_builders() -> Iterator[tuple[str, Callable[[Path], Path]]]:
    from lsa_models import DotProductMHA, Transformer, TransformerConfig
    from lsa_models.onnx import export_onnx
    from tests.onnx_l2_models import L2Attention
    from tests.zoo import harness
    from tests.zoo.cases import CASES

    def native(cfg: TransformerConfig, dynamo: bool) -> Callable[[Path], Path]:
        def make(path: Path) -> Path:
            torch.manual_seed(0)
            return export_onnx(Transformer(cfg), path, 5, dynamo=dynamo)
        return make

    for att in ("dp", "l2", "l2_untied"):
        for norm_first in (True, False):
            cfg = TransformerConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16, attention=att,
                                    norm_first=norm_first, final_norm=True,
                                    causal=att == "l2" and not norm_first)
            yield f"native-export:{att}:nf{int(norm_first)}", native(cfg, att != "dp")

    def dp_bare(path: Path) -> Path:
        torch.manual_seed(1)
        return export_onnx(DotProductMHA(8, 2), path, 4, dynamo=False)
    yield "native-export:dp-bare", dp_bare

    for form in ("broadcast", "cdist", "expanded"):
        for tied in (True, False):
            for causal in (False, True):
                def l2(path: Path, form: str = form, tied: bool = tied,
                       causal: bool = causal) -> Path:
                    m = L2Attention(8, 2, form=form, tied=tied, causal=causal, residual=True,
                                    seed=4)
                    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(5))
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        torch.onnx.export(m, (x,), str(path), dynamo=False, opset_version=17,
                                          input_names=["x"], output_names=["y"])
                    return path
                yield f"l2attn:{form}:t{int(tied)}:c{int(causal)}", l2

    wanted = {"l2-broadcast[(1, N, D)]", "l2-stpp[(N, 1, D)]", "l2-expanded-untied[(1, N, D)]",
              "torch-encoder-prenorm[(N, D)]", "torch-encoder-postnorm[(N, D)]",
              "torch-mha-causal-prenorm[(1, N, D)]", "sdpa-mask-prenorm[(1, N, D)]",
              "hf-gpt2[inputs_embeds]", "hf-bert[ids]", "hf-llama[inputs_embeds]",
              "timm-vit[pixels]", "hf-vit[patches]", "xt-decoder[(1, N, D)]"}
    for case in CASES:
        if case.key in wanted:
            exporter = case.exporters[0]

            def zoo(path: Path, case: Any = case, exporter: str = exporter) -> Path:
                return harness.export(case.build(), exporter, path)
            yield f"zoo:{case.key}:{exporter}", zoo


def onnx_results() -> dict[str, Any]:
    from lsa_models.onnx import analyse, load_onnx

    CACHE.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for name, build in _onnx_builders():
        fname = "".join(ch if ch.isalnum() else "_" for ch in name) + ".onnx"
        path = CACHE / fname
        if not path.exists():
            build(path)
        model = load_onnx(path.read_bytes(), path.name)
        fixed = model.spec.seq_len
        for norm in NORMS:
            for radius in (None, 0.5, 3.0):
                key = f"onnx:{name}:{norm}:r{radius}"
                try:
                    out[key] = summary(analyse(model, norm, fixed or 5, radius))
                except ValueError as exc:
                    out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def results() -> dict[str, Any]:
    return {**native_results(), **onnx_results()}


def _floats(x: Any) -> list[float]:
    if isinstance(x, str) and x.startswith(("0x", "-0x")) and "p" in x:
        return [float.fromhex(x)]
    if isinstance(x, (list, dict)):
        items = x.values() if isinstance(x, dict) else x
        return [f for item in items for f in _floats(item)]
    return []


def _skeleton(x: Any) -> Any:
    """The result with its floats blanked out."""
    if isinstance(x, str) and x.startswith(("0x", "-0x")) and "p" in x:
        return "<float>"
    if isinstance(x, list):
        return [_skeleton(i) for i in x]
    if isinstance(x, dict):
        return {k: _skeleton(v) for k, v in x.items()}
    return x


def tighter_by_rounding(old: Any, new: Any) -> bool:
    """Same verdicts, reasons and layers, and every number at most a few ulps lower (one
    upward rounding fewer: docs/bounds.md, "The bound engine")."""
    if _skeleton(old) != _skeleton(new):
        return False
    pairs = list(zip(_floats(old), _floats(new), strict=True))
    return all(b <= a and a - b <= 1e-14 * abs(a) for a, b in pairs)


def compare(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences, results only tighter by rounding)."""
    diffs = [f"missing now: {k}" for k in old if k not in new]
    diffs += [f"new case: {k}" for k in new if k not in old]
    tighter = []
    for k in old:
        if k in new and old[k] != new[k]:
            if tighter_by_rounding(old[k], new[k]):
                tighter.append(k)
                continue
            diffs.append(f"{k}:\n  before {json.dumps(old[k])[:2000]}\n  after  "
                         f"{json.dumps(new[k])[:2000]}")
    return diffs, tighter


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print("usage: python -m tests.engine_golden record|compare FILE.json", file=sys.stderr)
        return 2
    now = results()
    path = Path(argv[1])
    if argv[0] == "record":
        path.write_text(json.dumps(now, indent=1, sort_keys=True))
        print(f"{len(now)} results written to {path}")
        return 0
    diffs, tighter = compare(json.loads(path.read_text()), now)
    for d in diffs:
        print(d)
    for k in tighter:
        print(f"tighter by rounding only: {k}")
    print(f"{len(now)} results, {len(diffs)} differences, {len(tighter)} tighter by rounding "
          "only")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
