"""What lsa says today about the zoo cases whose right verdict it does not reach.

Keyed by (model, layout, exporter); each is an `xfail(strict=True)` case of the zoo test,
so a case lsa learns to read fails until its entry here is removed. Generated from a zoo
run (bench/out/zoo.json), then edited by hand."""

from __future__ import annotations

TODAY: dict[tuple[str, str, str], str] = {
    ("l2-stpp-causal", "(N, 1, D)", "torchscript"):
        "not_certified: logits (N, N, 1, h) (sequence-first Einsum): keys not on the last axis",
    ("l2-stpp-causal", "(N, 1, D)", "dynamo"):
        "not_certified: logits (N, N, 1, h) (sequence-first Einsum): keys not on the last axis",
    ("l2-stpp", "(N, 1, D)", "torchscript"):
        "not_certified: logits (N, N, 1, h) (sequence-first Einsum): keys not on the last axis",
    ("l2-stpp", "(N, 1, D)", "dynamo"):
        "not_certified: logits (N, N, 1, h) (sequence-first Einsum): keys not on the last axis",
    ("hf-llama", "inputs_embeds", "torchscript"):
        "not_certified: query/key not the same affine map at every position (rotary)",
    ("hf-llama", "inputs_embeds", "dynamo"):
        "not_certified: query/key not the same affine map at every position (rotary)",
    ("hf-llama", "ids", "torchscript"):
        "not_certified: query/key not the same affine map at every position (rotary)",
    ("hf-llama", "ids", "dynamo"):
        "not_certified: query/key not the same affine map at every position (rotary)",
}
