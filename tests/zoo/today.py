"""What lsa says today about the zoo cases whose right verdict it does not reach.

Keyed by (model, layout, exporter); each is an `xfail(strict=True)` case of the zoo test,
so a case lsa learns to read fails until its entry here is removed. Generated from a zoo
run (bench/out/zoo.json), then edited by hand."""

from __future__ import annotations

TODAY: dict[tuple[str, str, str], str] = {
    ("l2-broadcast", "(1, N, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-broadcast", "(N, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-broadcast", "(N, 1, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-broadcast-1head-causal", "(1, N, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-broadcast-residual", "(1, N, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-cdist", "(1, N, D)", "torchscript"):
        "not_certified: logits neither a scaled dot product nor -||q_i - q_j||^2 (cdist)",
    ("l2-cdist", "(N, D)", "torchscript"):
        "not_certified: logits neither a scaled dot product nor -||q_i - q_j||^2 (cdist)",
    ("l2-expanded", "(1, N, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-expanded", "(N, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-expanded-1head-causal", "(N, D)", "dynamo"):
        "not_certified: L2 logits recognised, the values P X A W^V not (A = W^Q W^Q^T / sqrt d)",
    ("l2-stpp-causal", "(N, 1, D)", "torchscript"):
        "not_certified: its input is not an N x N logits tensor",
    ("l2-stpp-causal", "(N, 1, D)", "dynamo"):
        "not_certified: its input is not an N x N logits tensor",
    ("l2-stpp", "(N, 1, D)", "torchscript"):
        "not_certified: its input is not an N x N logits tensor",
    ("l2-stpp", "(N, 1, D)", "dynamo"):
        "not_certified: its input is not an N x N logits tensor",
    ("torch-encoder-prenorm", "(N, D)", "torchscript"):
        "not_certified: packed QKV: the nodes between x and the Gemm feed other tensors",
    ("torch-encoder-prenorm", "(N, D)", "dynamo"):
        "not_certified: packed QKV: the nodes between x and linear_1 feed other tensors",
    ("torch-encoder-postnorm", "(N, D)", "torchscript"):
        "not_certified: packed QKV: the nodes between x and the Gemm feed other tensors",
    ("torch-encoder-postnorm", "(N, D)", "dynamo"):
        "not_certified: packed QKV: the nodes between x and linear_1 feed other tensors",
    ("sdpa-mask-prenorm", "(1, N, D)", "torchscript"):
        "not_certified: its probabilities are not used only as P @ V",
    ("sdpa-mask-prenorm", "(1, N, D)", "dynamo"):
        "not_certified: its probabilities are not used only as P @ V",
    ("hf-gpt2", "inputs_embeds", "torchscript"):
        "refused: the graph's constants could not be evaluated: index out of range in self",
    ("hf-gpt2", "ids", "torchscript"):
        "refused: the graph has no float input",
    ("hf-gpt2", "ids", "dynamo"):
        "refused: the graph has no float input",
    ("hf-bert", "inputs_embeds", "torchscript"):
        "refused: unsupported ops: GatherElements",
    ("hf-bert", "ids", "torchscript"):
        "refused: unsupported ops: GatherElements",
    ("hf-distilbert", "inputs_embeds", "torchscript"):
        "refused: the graph's constants could not be evaluated: index out of range in self",
    ("hf-distilbert", "ids", "torchscript"):
        "refused: the graph's constants could not be evaluated: index out of range in self",
    ("hf-llama", "inputs_embeds", "torchscript"):
        "refused: unsupported ops: Cos x1, Sin x1 (rotary)",
    ("hf-llama", "inputs_embeds", "dynamo"):
        "not_certified: Pow node outside a recognised pattern (RMSNorm)",
    ("hf-llama", "ids", "torchscript"):
        "refused: unsupported ops: Cos x1, Sin x1 (rotary)",
    ("hf-llama", "ids", "dynamo"):
        "not_certified: Pow node outside a recognised pattern (RMSNorm)",
    ("hf-vit", "pixels", "torchscript"):
        "refused: unsupported ops: Conv x1",
    ("hf-vit", "pixels", "dynamo"):
        "refused: unsupported ops: Conv x1",
    ("hf-vit", "patches", "torchscript"):
        "not_certified: its input is not an N x N logits tensor",
    ("hf-vit", "patches", "dynamo"):
        "not_certified: its input is not an N x N logits tensor",
    ("timm-vit", "pixels", "torchscript"):
        "refused: unsupported ops: Conv x1",
    ("timm-vit", "pixels", "dynamo"):
        "refused: unsupported ops: Conv x1",
    ("timm-vit", "patches", "torchscript"):
        "not_certified: its input is not an N x N logits tensor",
    ("timm-vit", "patches", "dynamo"):
        "not_certified: its input is not an N x N logits tensor",
    ("timm-deit-distilled", "pixels", "torchscript"):
        "refused: unsupported ops: Conv x1",
    ("timm-deit-distilled", "pixels", "dynamo"):
        "refused: unsupported ops: Conv x1",
    ("timm-deit-distilled", "patches", "torchscript"):
        "not_certified: its input is not an N x N logits tensor",
    ("timm-deit-distilled", "patches", "dynamo"):
        "not_certified: its input is not an N x N logits tensor",
    ("xt-encoder", "(1, N, D)", "torchscript"):
        "not_certified: its probabilities are not used only as P @ V",
    ("xt-encoder", "(1, N, D)", "dynamo"):
        "not_certified: its probabilities are not used only as P @ V",
    ("xt-decoder", "(1, N, D)", "torchscript"):
        "not_certified: its probabilities are not used only as P @ V",
    ("xt-decoder", "(1, N, D)", "dynamo"):
        "not_certified: its probabilities are not used only as P @ V",
}
