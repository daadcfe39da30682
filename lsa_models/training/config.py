"""Optimisation settings of one training run (the model's shape lives in `lm.LMConfig`).

Invalid values raise `config.ConfigError` naming the field, like every other library config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..config import ConfigError

Device = Literal["auto", "cpu", "cuda"]


class TrainingDivergedError(RuntimeError):
    """The training loss became NaN or infinite."""


def _int_field(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum \
            or (maximum is not None and value > maximum):
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise ConfigError(name, f"must be an integer {bound}, got {value!r}")


def _float_field(name: str, value: Any, low: float, high: float | None = None,
                 open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > low if open_low else value >= low
        ok = ok and (high is None or value <= high)
    if not ok:
        rng = f"{'>' if open_low else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(name, f"must be a finite number {rng}, got {value!r}")


def select_device(device: str = "auto") -> torch.device:
    """'auto': CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA was requested but no GPU is available; use 'auto'")
    if device not in ("cpu", "cuda"):
        raise ConfigError("device", f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one run, and what `train_certified` checks afterwards."""

    steps: int
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 0
    fixed_lr: bool = False  # constant lr at every step: no warmup, no decay
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.01  # 0: plain Adam
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float | None = 1.0  # max global grad norm; None: no clipping
    eval_every: int = 0  # 0: evaluate only at the end
    eval_tokens: int | None = 16384  # validation characters per evaluation; None: whole split
    checkpoint_every: int = 0  # 0: no checkpoints
    progress_every: int = 10
    seed: int = 0
    device: Device = "auto"
    spike_nats: float = 1.0  # a loss this far above the best smoothed loss is a divergence event
    recon_sequences: int = 8  # held-out test sequences the certified inverse reconstructs
    inverse_atol: float = 1e-8  # per-block fixed-point tolerance of that inverse (float64)

    def __post_init__(self) -> None:
        _int_field("steps", self.steps, 1, 10_000_000)
        _int_field("batch_size", self.batch_size, 1, 65_536)
        _float_field("lr", self.lr, 0.0, 10.0, open_low=True)
        _int_field("warmup_steps", self.warmup_steps, 0)
        if not isinstance(self.fixed_lr, bool):
            raise ConfigError("fixed_lr", f"must be a boolean, got {self.fixed_lr!r}")
        if self.fixed_lr and self.warmup_steps:
            raise ConfigError("warmup_steps", "must be 0 with fixed_lr (a fixed learning rate "
                              "has no warmup)")
        _float_field("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _float_field("weight_decay", self.weight_decay, 0.0, 10.0)
        _float_field("beta1", self.beta1, 0.0, 1.0)
        _float_field("beta2", self.beta2, 0.0, 1.0)
        if self.grad_clip is not None:
            _float_field("grad_clip", self.grad_clip, 0.0, open_low=True)
        self._check_counts()
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", f"unknown device {self.device!r}; use auto, cpu or cuda")
        _float_field("spike_nats", self.spike_nats, 0.0, open_low=True)
        _float_field("inverse_atol", self.inverse_atol, 0.0, open_low=True)

    def _check_counts(self) -> None:
        _int_field("eval_every", self.eval_every, 0)
        if self.eval_tokens is not None:
            _int_field("eval_tokens", self.eval_tokens, 1)
        _int_field("checkpoint_every", self.checkpoint_every, 0)
        _int_field("progress_every", self.progress_every, 1)
        _int_field("seed", self.seed, 0, 2**62)
        _int_field("recon_sequences", self.recon_sequences, 1, 1024)

    def lr_at(self, step: int) -> float:
        """Learning rate of 0-based step `step`."""
        if self.fixed_lr:
            return self.lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 *
                          (1 + math.cos(math.pi * t)))


__all__ = ["Device", "TrainConfig", "TrainingDivergedError", "select_device"]
