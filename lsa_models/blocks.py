"""Transformer blocks and stacks built from the attention layers."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import L2MHA, DotProductMHA, build_attention
from .config import BlockConfig, FFNConfig, TransformerConfig

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
}


class FeedForward(nn.Module):
    """Token-wise `act(x W1 + b1) W2 + b2`."""

    def __init__(self, config: FFNConfig) -> None:
        super().__init__()
        self.config = config
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.act = _ACTIVATIONS[config.activation]()
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fc1.weight, std=self.config.d_model ** -0.5)
        nn.init.normal_(self.fc2.weight, std=self.config.d_ff ** -0.5)
        nn.init.zeros_(self.fc1.bias)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        return self.fc2(self.act(self.fc1(x)))  # (B, N, D)


class TransformerBlock(nn.Module):
    """Pre-norm `x + A(LN1(x)); x + FFN(LN2(x))`, or post-norm `LN1(x + A(x)); LN2(x + FFN(x))`."""

    def __init__(self, config: BlockConfig) -> None:
        super().__init__()
        self.config = config
        self.ln1 = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.attn: DotProductMHA | L2MHA = build_attention(config.attention)
        self.ln2 = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.ffn = FeedForward(config.ffn)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        if self.config.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class Transformer(nn.Module):
    """A stack of blocks on continuous token sequences: (B, N, D) -> (B, N, D)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        block = config.block()
        self.blocks = nn.ModuleList(TransformerBlock(block) for _ in range(config.n_layers))
        self.final_norm: nn.LayerNorm | None = (
            nn.LayerNorm(config.d_model, eps=config.ln_eps) if config.final_norm else None
        )

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        for blk in self.blocks:
            x = blk(x)
        return x if self.final_norm is None else self.final_norm(x)


__all__ = ["FeedForward", "Transformer", "TransformerBlock"]
