"""A causal character-level Transformer language model (docs/theory.md, "The
language-modelling experiment"): token + learned position embeddings, a trunk of residual
blocks, a final LayerNorm and a linear read-out.

Attention (the library's one vocabulary, `config.ATTENTION_NAMES`):
- `dp`: dot-product attention, pre-norm blocks;
- `l2`: L2 attention with tied query/key weights (Theorem 3.2), pre-norm blocks;
- `l2_untied`: L2 attention with separate key weights (not certifiable), pre-norm blocks;
- `contractive_l2`: the certified invertible trunk of `invertible.ContractiveTrunk`
  (no LayerNorm inside the residual branches: its Lipschitz bound 1/sqrt(eps) would force the
  branch scale towards zero).
`l2_tied` is still accepted as the old name of `l2`. Checkpoints of format version 1 used `l2`
for the untied layer; `checkpoint` translates them on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .blocks import Transformer
from .bounds.layer_graph import Layer, Series
from .bounds.rules import Lowering, LoweringRule, register_rule
from .checkpoint import register_model_kind
from .config import AttentionName, ConfigError, TransformerConfig, _positive_int, attention_name
from .invertible import ContractiveTrunk, ContractiveTrunkConfig


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    seq_len: int = 64
    attention: AttentionName = "contractive_l2"
    c: float = 0.9
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = "relu"
    ln_eps: float = 1e-5
    norm_first: bool = True  # pre-norm blocks (dp, l2, l2_untied); False: post-norm

    # (contractive_l2 has no LayerNorm in its residual branches, so norm_first does not apply.)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "seq_len"):
            _positive_int(name, getattr(self, name))
        # frozen: the canonical word (an alias translated) is what the checkpoint stores
        object.__setattr__(self, "attention", attention_name(self.attention))
        if not isinstance(self.norm_first, bool):
            raise ConfigError("norm_first", f"must be a boolean, got {self.norm_first!r}")
        self.trunk_config()  # validates the shared fields (heads divide width, c in (0,1), ...)

    def trunk_config(self) -> TransformerConfig | ContractiveTrunkConfig:
        if self.attention == "contractive_l2":
            return ContractiveTrunkConfig(self.d_model, self.n_heads, self.n_layers, self.d_ff,
                                          self.seq_len, self.c, True, self.activation)
        word: Literal["dp", "l2", "l2_untied"] = self.attention
        return TransformerConfig(self.d_model, self.n_heads, self.n_layers, self.d_ff,
                                 attention=word, causal=True,
                                 activation=self.activation, norm_first=self.norm_first,
                                 ln_eps=self.ln_eps, final_norm=False)


class CharTransformerLM(nn.Module):
    """(B, N) int64 character ids -> (B, N, V) next-character logits, N <= seq_len."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Parameter(torch.zeros(config.seq_len, config.d_model))
        trunk_cfg = config.trunk_config()
        self.trunk: Transformer | ContractiveTrunk = (
            ContractiveTrunk(trunk_cfg) if isinstance(trunk_cfg, ContractiveTrunkConfig)
            else Transformer(trunk_cfg)
        )
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        nn.init.normal_(self.tok_emb.weight, std=1.0)
        nn.init.normal_(self.pos_emb, std=0.1)
        nn.init.normal_(self.head.weight, std=config.d_model ** -0.5)
        nn.init.zeros_(self.head.bias)

    def embed(self, idx: Tensor) -> Tensor:  # (B, N) -> (B, N, D)
        n = idx.shape[1]
        if n > self.config.seq_len:
            raise ValueError(f"sequence of {n} characters exceeds seq_len={self.config.seq_len}")
        return self.tok_emb(idx) + self.pos_emb[:n]  # (B, N, D)

    def readout(self, h: Tensor) -> Tensor:  # (B, N, D) -> (B, N, V)
        return self.head(self.ln_f(h))

    def forward(self, idx: Tensor) -> Tensor:  # (B, N) -> (B, N, V)
        return self.readout(self.trunk(self.embed(idx)))

    def continuous_part(self) -> LMContinuous:
        """The map that bounds and empirical searches analyse: embedded tokens -> logits.

        Token ids are discrete, so (as with an ONNX Gather) the continuous input starts after
        the embedding lookup."""
        return LMContinuous(self)


class LMContinuous(nn.Module):
    """`head(ln_f(trunk(H)))` on embedded sequences: (B, N, D) -> (B, N, V). Shares weights."""

    def __init__(self, lm: CharTransformerLM) -> None:
        super().__init__()
        self.config = lm.config
        self.default_seq_len = lm.config.seq_len
        self.trunk = lm.trunk
        self.ln_f = lm.ln_f
        self.head = lm.head

    def forward(self, h: Tensor) -> Tensor:  # (B, N, D) -> (B, N, V)
        return self.head(self.ln_f(self.trunk(h)))


@register_rule(LMContinuous)
class LMContinuousRule(LoweringRule):
    """The continuous part is the series trunk, final LayerNorm, read-out: each part's output
    radius is the next one's input radius, the constants multiply (the engine's `Series`)."""

    def lower(self, module: LMContinuous, name: str, lowering: Lowering) -> Layer:
        prefix = f"{name}." if name else ""
        return Series(name, [lowering(getattr(module, child), prefix + child)
                             for child in ("trunk", "ln_f", "head")])


register_model_kind("char_lm", CharTransformerLM, LMConfig)

__all__ = ["CharTransformerLM", "LMConfig", "LMContinuous"]
