"""What lsa says today about the zoo cases whose right verdict it does not reach.

Keyed by (model, layout, exporter); each is an `xfail(strict=True)` case of the zoo test,
so a case lsa learns to read fails until its entry here is removed. Generated from a zoo
run (bench/out/zoo.json), then edited by hand."""

from __future__ import annotations

TODAY: dict[tuple[str, str, str], str] = {
    ("sdpa-mask-prenorm", "(1, N, D)", "torchscript"):
        "not_certified: its probabilities are not used only as P @ V (they feed IsNaN, Where)",
    ("sdpa-mask-prenorm", "(1, N, D)", "dynamo"):
        "not_certified: its probabilities are not used only as P @ V (they feed IsNaN, Where)",
    ("xt-decoder", "(1, N, D)", "torchscript"):
        "not_certified: Where replaces masked logits by a finite constant (masked_fill)",
    ("xt-decoder", "(1, N, D)", "dynamo"):
        "not_certified: Where replaces masked logits by a finite constant (masked_fill)",
}
