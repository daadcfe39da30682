"""Three small classifiers (an MLP, 1- and 2-layer pre-norm Transformers: kinds mlp, tf1, tf2
with standard LayerNorm, D=16, N=8), built from seeds and exported to ONNX; shared by the local
tests and the benchmarks.

The Transformers are written with explicit attention (Linear q/k/v, softmax(q k^T / sqrt(d)) v,
an output Linear, nn.LayerNorm, a tanh-GELU FFN) rather than nn.TransformerEncoderLayer, whose
scaled_dot_product_attention auto_LiRPA (the benchmark baseline) cannot trace: both tools read
the same model. The GELU is written out in its tanh form (GPT-2's) because auto_LiRPA has no
Erf and no fused Gelu."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

D, N, CLASSES, HEADS, D_FF = 16, 8, 4, 2, 32
_C = math.sqrt(2.0 / math.pi)


class GeluTanh(nn.Module):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as explicit Mul/Add/Tanh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * x * x * x)))


class MLPClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(1), nn.Linear(N * D, 64), GeluTanh(),
                                 nn.Linear(64, 32), GeluTanh(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, K)
        return self.net(x)


class Attention(nn.Module):
    """Multi-head dot-product self-attention, every step an explicit op."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N, D)
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, n, self.h, self.dh).transpose(1, 2)  # (B, H, N, dh)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        a = torch.softmax(q.matmul(k.transpose(-1, -2)) / math.sqrt(self.dh), dim=-1)  # (B,H,N,N)
        y = a.matmul(v).transpose(1, 2).reshape(b, n, d)  # (B, N, D)
        return self.o(y)


class Block(nn.Module):
    """Pre-norm: x + attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(D, HEADS)
        self.ff = nn.Sequential(nn.Linear(D, D_FF), GeluTanh(), nn.Linear(D_FF, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class TransformerClassifier(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, K)
        for b in self.blocks:
            x = b(x)  # (B, N, D)
        return self.head(self.norm(x).mean(dim=1))  # (B, K)


KINDS = ("mlp", "tf1", "tf2")


def relu_mlp(seed: int = 0) -> nn.Module:
    """A ReLU MLP of the same input (128-64-32-4): the commonest model there is, for the
    ReLU rules' tests (not one of the three KINDS)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(1), nn.Linear(N * D, 64), nn.ReLU(), nn.Linear(64, 32),
                         nn.ReLU(), nn.Linear(32, CLASSES)).eval()


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model: nn.Module
    if kind == "mlp":
        model = MLPClassifier()
    elif kind in ("tf1", "tf2"):
        model = TransformerClassifier(int(kind[-1]))
    else:
        raise ValueError(f"unknown classifier {kind!r}; one of {KINDS}")
    return model.eval()


def export(model: nn.Module, path: Path) -> Path:
    x = torch.randn(1, N, D)
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=18,
                      input_names=["x"], output_names=["logits"])
    return path


def center(seed: int = 1) -> torch.Tensor:
    """A centre input X0 (1, N, D)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, N, D, generator=g)
