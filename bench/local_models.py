"""The three small classifiers of issue 15 (an MLP, 1- and 2-layer pre-norm Transformers with
standard LayerNorm, D=16, N=8), built from seeds and exported to ONNX; shared by the local
tests and the benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

D, N, CLASSES = 16, 8, 4


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU in its tanh form (GPT-2's): auto_LiRPA, the benchmark baseline, has no Erf."""
    return nn.functional.gelu(x, approximate="tanh")


class MLPClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(1), nn.Linear(N * D, 64), nn.GELU("tanh"),
                                 nn.Linear(64, 32), nn.GELU("tanh"), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, K)
        return self.net(x)


class TransformerClassifier(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True, norm_first=True,
                                       activation=_gelu_tanh)
            for _ in range(layers)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, K)
        for b in self.blocks:
            x = b(x)  # (B, N, D)
        return self.head(self.norm(x).mean(dim=1))  # (B, K)


KINDS = ("mlp", "tf1", "tf2")


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
    # with autograd on: torch's fused encoder-layer kernel (no ONNX export) stays unused
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=18,
                      input_names=["x"], output_names=["logits"])
    return path


def center(seed: int = 1) -> torch.Tensor:
    """A centre input X0 (1, N, D)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, N, D, generator=g)
