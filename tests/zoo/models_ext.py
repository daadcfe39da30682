"""Models from HF transformers, timm and x-transformers, built from tiny configs with random
weights (`from_config`-style constructors: nothing downloads). Eager attention everywhere, so
the float64 Jacobian ascent can differentiate twice. The libraries are imported here, inside
the builders: they are a test extra (`pip install -e '.[zoo]'`) and load slowly."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import tv_schemas  # noqa: F401  (before timm/transformers import torchvision)

DROPOUT0 = 0.0


def _all_ones(x: Tensor) -> Tensor:
    """An explicit all-ones attention mask (B, N), as users pass one. Without it transformers
    5 looks for packed sequences with `torch.diff`, which the TorchScript exporter lacks."""
    return torch.ones(x.shape[0], x.shape[1], dtype=torch.long, device=x.device)


class HFEmbeds(nn.Module):
    """An HF base model called on `inputs_embeds` (B, N, D) -> last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        return self.model(inputs_embeds=x, attention_mask=_all_ones(x))[0]  # (B, N, D)


class HFIds(nn.Module):
    """An HF base model called on token ids (B, N) -> last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:  # (B, N) int64
        return self.model(input_ids=ids, attention_mask=_all_ones(ids))[0]  # (B, N, D)


def gpt2(d: int, heads: int, layers: int, n: int, vocab: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(vocab_size=vocab, n_positions=max(n, 16), n_embd=d, n_layer=layers,
                     n_head=heads, resid_pdrop=DROPOUT0, embd_pdrop=DROPOUT0,
                     attn_pdrop=DROPOUT0, use_cache=False, attn_implementation="eager")
    return GPT2Model(cfg).eval()


def bert(d: int, heads: int, layers: int, vocab: int = 64) -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=2 * d,
                     max_position_embeddings=16, hidden_dropout_prob=DROPOUT0,
                     attention_probs_dropout_prob=DROPOUT0, attn_implementation="eager")
    return BertModel(cfg, add_pooling_layer=False).eval()


def distilbert(d: int, heads: int, layers: int, vocab: int = 64) -> nn.Module:
    from transformers import DistilBertConfig, DistilBertModel

    cfg = DistilBertConfig(vocab_size=vocab, dim=d, n_layers=layers, n_heads=heads,
                           hidden_dim=2 * d, max_position_embeddings=16, dropout=DROPOUT0,
                           attention_dropout=DROPOUT0, attn_implementation="eager")
    return DistilBertModel(cfg).eval()


def llama(d: int, heads: int, layers: int, vocab: int = 64) -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=16, use_cache=False,
                      attn_implementation="eager")
    return LlamaModel(cfg).eval()


def hf_vit(d: int, heads: int, layers: int, image: int, patch: int) -> nn.Module:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(image_size=image, patch_size=patch, num_channels=3, hidden_size=d,
                    num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=2 * d, hidden_dropout_prob=DROPOUT0,
                    attention_probs_dropout_prob=DROPOUT0, attn_implementation="eager")
    return ViTModel(cfg, add_pooling_layer=False).eval()


class HFViTPixels(nn.Module):
    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, pixels: Tensor) -> Tensor:  # (B, 3, H, W)
        return self.vit(pixel_values=pixels)[0]  # (B, 1 + P, D)


class HFViTPatches(nn.Module):
    """HF ViT after its patch embedding: (B, P, D) patches -> CLS concatenated, positions
    added, encoder, final LayerNorm: (B, 1 + P, D)."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, patches: Tensor) -> Tensor:  # (B, P, D)
        emb = self.vit.embeddings
        cls = emb.cls_token.expand(patches.shape[0], -1, -1)  # (B, 1, D)
        h = torch.cat([cls, patches], dim=1) + emb.position_embeddings  # (B, 1 + P, D)
        for layer in self.vit.layers:
            h = layer(h, None)
        return self.vit.layernorm(h)  # (B, 1 + P, D)


def timm_vit(d: int, heads: int, layers: int, image: int, patch: int,
             distilled: bool = False) -> nn.Module:
    import timm

    name = "deit_tiny_distilled_patch16_224" if distilled else "vit_tiny_patch16_224"
    model = timm.create_model(name, pretrained=False, img_size=image, patch_size=patch,
                              embed_dim=d, depth=layers, num_heads=heads, num_classes=0)
    for blk in model.blocks:  # eager attention (double backward in float64)
        blk.attn.fused_attn = False
    return model.eval()


class TimmPixels(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: Tensor) -> Tensor:  # (B, 3, H, W)
        return self.model.forward_features(pixels)  # (B, T + P, D)


class TimmPatches(nn.Module):
    """timm ViT/DeiT after its patch embedding: class (and distillation) tokens and positions
    (`_pos_embed`), blocks, final norm."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, patches: Tensor) -> Tensor:  # (B, P, D)
        m = self.model
        h = m.norm_pre(m._pos_embed(patches))  # (B, T + P, D)
        return m.norm(m.blocks(h))  # (B, T + P, D)


def xt_encoder(d: int, heads: int, layers: int, causal: bool) -> nn.Module:
    from x_transformers import Decoder, Encoder

    cls = Decoder if causal else Encoder
    return cls(dim=d, depth=layers, heads=heads, attn_dim_head=d // heads).eval()
