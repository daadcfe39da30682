"""Certified robustness radii on classifiers from other libraries (HF BERT / DistilBERT / GPT-2 /
LLaMA sequence classification on inputs_embeds, HF and timm ViT on pixels, x-transformers and
torch encoders under a mean-pool head; tiny configs, random weights, nothing downloads):
certified radius against the PGD attack radius (certified <= true <= attack), both norms.
With --baseline each model also runs with the centre's forward error bounded by float64
intervals alone (forward_ball.MAX_OPS = 0: no ball arithmetic), in the same run.
Writes bench/out/robustness_zoo.json and .png and prints a table.

    .venv/bin/python bench/robustness_zoo.py [--only xt-encoder ...] [--norms inf 2] [--baseline]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.zoo.tv_schemas  # noqa: E402,F401  (before timm/transformers import torchvision)
from lsa_models.engine.rounding import forward_ball  # noqa: E402
from lsa_models.engine.routes.certify import robustness  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402
from service.bounds.local import model_input  # noqa: E402
from tests.onnx_export import export_to  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
D, N, CLASSES, IMAGE, PATCH = 32, 8, 3, 16, 8


class _Embeds(nn.Module):
    """An HF sequence classifier called on inputs_embeds (B, N, D) -> logits (B, C)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], x.shape[1], dtype=torch.long)
        return self.model(inputs_embeds=x, attention_mask=mask).logits


class _Pixels(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W)
        return self.model(pixel_values=x).logits


class _MeanHead(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        return self.head(self.body(x).mean(dim=1))  # (B, C)


def _hf(kind: str) -> nn.Module:
    import transformers as tf

    common = dict(num_labels=CLASSES, attn_implementation="eager")
    if kind == "bert":
        cfg = tf.BertConfig(vocab_size=64, hidden_size=D, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=2 * D,
                            max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **common)
        return _Embeds(tf.BertForSequenceClassification(cfg))
    if kind == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=64, dim=D, n_layers=2, n_heads=2,
                                  hidden_dim=2 * D, max_position_embeddings=16, dropout=0.0,
                                  attention_dropout=0.0, seq_classif_dropout=0.0, **common)
        return _Embeds(tf.DistilBertForSequenceClassification(cfg))
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=D, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                            pad_token_id=0, **common)
        return _Embeds(tf.GPT2ForSequenceClassification(cfg))
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=64, hidden_size=D, intermediate_size=2 * D,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                             max_position_embeddings=16, use_cache=False, pad_token_id=0,
                             **common)
        return _Embeds(tf.LlamaForSequenceClassification(cfg))
    cfg = tf.ViTConfig(image_size=IMAGE, patch_size=PATCH, hidden_size=D, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=2 * D, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, **common)
    return _Pixels(tf.ViTForImageClassification(cfg))


def _timm_vit() -> nn.Module:
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE,
                              patch_size=PATCH, embed_dim=D, depth=2, num_heads=2,
                              num_classes=CLASSES)
    for blk in model.blocks:  # eager attention (the attack differentiates in float64)
        blk.attn.fused_attn = False
    return model


def _xt() -> nn.Module:
    from x_transformers import ContinuousTransformerWrapper, Encoder

    return _MeanHead(ContinuousTransformerWrapper(
        dim_in=D, max_seq_len=N, attn_layers=Encoder(dim=D, depth=2, heads=2)))


def _torch_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True,
                                       norm_first=True)
    return _MeanHead(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


TEXT, IMG = (1, N, D), (1, 3, IMAGE, IMAGE)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "hf-bert": (lambda: _hf("bert"), TEXT),
    "hf-distilbert": (lambda: _hf("distilbert"), TEXT),
    "hf-gpt2": (lambda: _hf("gpt2"), TEXT),
    "hf-llama": (lambda: _hf("llama"), TEXT),
    "hf-vit": (lambda: _hf("vit"), IMG),
    "timm-vit": (_timm_vit, IMG),
    "xt-encoder": (_xt, TEXT),
    "torch-encoder-prenorm": (_torch_encoder, TEXT),
}


class _Loaded:
    """What service.bounds.local.model_input reads: the upload's ONNX model."""

    def __init__(self, om: Any) -> None:
        self.onnx = om


def export_model(name: str, path: Path) -> tuple[nn.Module, torch.Tensor]:
    """The torch model (seed 0, eval mode) exported to ONNX at `path`, and its centre input
    (seed 1; an image on pixel models)."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make().eval()
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        export_to(model, x, path, dynamo=False)
    return model, x


def load(name: str, tmp: Path) -> tuple[Any, np.ndarray]:
    """The model exported to ONNX and loaded, and its centre input (pixels as patches)."""
    path = tmp / f"{name}.onnx"
    _, x = export_model(name, path)
    om = load_onnx(path.read_bytes())
    return om, model_input(_Loaded(om), x.numpy().astype(np.float64))  # pixels -> patches


def run(name: str, norms: list[str], baseline: bool, tmp: Path) -> list[dict[str, Any]]:
    om, x0 = load(name, tmp)
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f64(torch.from_numpy(x0)).argmax())
    rows = []
    modes = ["balls", "intervals"] if baseline else ["balls"]
    for norm in norms:
        for mode in modes:
            saved = forward_ball.MAX_OPS
            forward_ball.MAX_OPS = saved if mode == "balls" else 0
            t0 = time.monotonic()
            try:
                r = robustness(om, x0, label, norm)  # type: ignore[arg-type]
            finally:
                forward_ball.MAX_OPS = saved
            attack = r.attack_radius
            rows.append(dict(model=name, norm=norm, forward=mode, label=label,
                             certified=r.certified_radius, attack=attack,
                             ratio=None if not attack else r.certified_radius / attack,
                             certified_by=r.certified_by, certify_s=r.certify_seconds,
                             attack_s=r.attack_seconds, seconds=time.monotonic() - t0))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["norm"]) for r in rows})
    modes = sorted({r["forward"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(keys)), 4))
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        vals = [next((r["ratio"] or 0.0 for r in rows if (r["model"], r["norm"]) == key
                      and r["forward"] == mode), 0.0) for key in keys]
        ax.bar(np.arange(len(keys)) + k * width, vals, width, label=f"forward error: {mode}")
    ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2,
                  [f"{m}\n{n}" for m, n in keys], rotation=45, ha="right", fontsize=7)
    ax.axhline(0.6, color="gray", lw=0.8, ls="--")
    ax.set_ylabel("certified / attack radius")
    ax.set_title("Certified robustness radius on library classifiers (random weights)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    ap.add_argument("--norms", nargs="*", choices=["inf", "2"], default=["inf", "2"])
    ap.add_argument("--baseline", action="store_true",
                    help="also run with the interval forward error alone (the engine before "
                         "the ball arithmetic), in the same run")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(MODELS):
            rows += run(name, args.norms, args.baseline, Path(tmp))
    (OUT / "robustness_zoo.json").write_text(json.dumps(rows, indent=2))
    plot(rows, OUT / "robustness_zoo.png")
    print(f"\n{'model':24s} {'norm':4s} {'forward':9s} {'certified':>10s} {'attack':>10s} "
          f"{'ratio':>6s} {'by':7s} {'s':>6s}")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['model']:24s} {r['norm']:4s} {r['forward']:9s} {r['certified']:10.4g} "
              f"{r['attack'] or float('nan'):10.4g} {ratio:>6s} {r['certified_by']:7s} "
              f"{r['seconds']:6.1f}")


if __name__ == "__main__":
    main()
