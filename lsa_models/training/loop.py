"""The training loop: AdamW (Adam when weight_decay = 0), optional linear warmup then cosine
decay, or a fixed learning rate (the stability experiment), gradient clipping,
bits-per-character evaluation, checkpoints every K steps, exact resume, seeds, device
auto-selection (CUDA with bf16 autocast when present) and progress reports.

Exact resume: the batch of step t is drawn from a generator seeded by (seed, t), the learning
rate is a function of t, the model has no dropout and the optimizer state is restored
bit for bit (with the contractive blocks' warm-start vectors), so on CPU a resumed run repeats
the uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import checkpoint
from ..config import ConfigError
from ..data import CharCorpus, eval_windows, random_windows
from ..invertible import NonFiniteWeightsError, frozen_scales
from ..lm import CharTransformerLM, LMConfig
from .checkpoints import (
    load_optimizer_state,
    load_power_state,
    read_train_state,
    save_checkpoint,
)
from .config import TrainConfig, select_device
from .history import LN2, History, Progress, ProgressCallback

# Settings a resumed run may change: they do not alter the optimisation trajectory.
_RESUMABLE_CHANGES = ("steps", "device", "progress_every", "recon_sequences", "inverse_atol")


@dataclass
class TrainResult:
    model: CharTransformerLM
    history: History
    device: str
    steps_done: int
    wall_s: float


def _batch_generator(seed: int, step: int) -> torch.Generator:
    # Batches depend only on (seed, step): a resumed run draws the same ones.
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate_bpc(model: CharTransformerLM, data: Tensor, max_tokens: int | None = None,
                 batch_size: int = 64) -> float:
    """Bits per character of next-character prediction over consecutive windows."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    x, y = eval_windows(data, model.config.seq_len, max_tokens)  # (W, N) each
    total, count = 0.0, 0
    with frozen_scales(model):
        for i in range(0, x.shape[0], batch_size):
            xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
            with autocast(device):
                logits = model(xb)  # (b, N, V)
            nll = F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum")
            total += float(nll)
            count += yb.numel()
    model.train(was_training)
    return total / count / LN2


def _optimizer(model: CharTransformerLM, config: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "emb" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.beta1, config.beta2), foreach=False)


@dataclass
class _Resumed:
    history: History
    start: int
    meta: dict[str, str]
    state_tensors: dict[str, Tensor]


def _resume(model: CharTransformerLM, path: Path, config: TrainConfig) -> _Resumed:
    """Load a checkpoint written by `train_lm` into `model`, after checking it is the same run."""
    loaded = checkpoint.load(path)
    if not isinstance(loaded, CharTransformerLM):
        raise checkpoint.CheckpointError("kind", "the checkpoint is not a char_lm model")
    if loaded.config != model.config:
        raise ConfigError("model_config", "differs from the checkpoint's; resume with the "
                          "same model shape")
    meta, opt_tensors = read_train_state(Path(path))
    saved = json.loads(meta["train_config"])
    for name, value in dataclasses.asdict(config).items():
        if name not in _RESUMABLE_CHANGES and saved.get(name) != value:
            raise ConfigError(name, f"{value!r} differs from the checkpoint's "
                              f"{saved.get(name)!r}; resume with the same settings")
    model.load_state_dict(loaded.state_dict())
    history = History.from_dict(json.loads(meta["history"]))
    return _Resumed(history, int(meta["step"]), meta, opt_tensors)


def _loss(model: CharTransformerLM, x: Tensor, y: Tensor,
          device: torch.device) -> tuple[Tensor | None, float]:
    """The step's loss tensor and its value; (None, nan) when a contractive block finds
    non-finite weights (it cannot bound them, so there is no forward pass)."""
    try:
        with autocast(device):
            logits = model(x)  # (B, N, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    except NonFiniteWeightsError:
        return None, math.nan
    return loss, float(loss.detach())


class _Throughput:
    """Tokens per second of training steps only (evaluations are not counted), per interval."""

    def __init__(self) -> None:
        self.seconds, self.tokens = 0.0, 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def take(self) -> float:
        tps = self.tokens / max(self.seconds, 1e-9)
        self.seconds, self.tokens = 0.0, 0
        return tps


def train_lm(model_config: LMConfig, corpus: CharCorpus, config: TrainConfig,
             checkpoint_dir: Path | None = None, resume_from: Path | None = None,
             progress: ProgressCallback | None = None,
             stop_at: int | None = None) -> TrainResult:
    """Train from scratch (seeded) or resume from a checkpoint written by this function.

    `progress` gets a "training" report every `config.progress_every` steps and at the last
    one (fraction = steps done / config.steps). `stop_at` ends the run after that many steps
    without changing the schedule (the lr still follows `config.steps`): how an interrupted
    run is simulated.
    """
    if model_config.vocab_size < corpus.vocab.size:
        raise ConfigError("vocab_size", f"{model_config.vocab_size} is smaller than the "
                          f"corpus vocabulary ({corpus.vocab.size} characters)")
    device = select_device(config.device)
    torch.manual_seed(config.seed)
    model = CharTransformerLM(model_config)
    resumed = None if resume_from is None else _resume(model, resume_from, config)
    history = History() if resumed is None else resumed.history
    start = 0 if resumed is None else resumed.start
    model.to(device).train()
    optimizer = _optimizer(model, config)
    if resumed is not None:
        load_optimizer_state(optimizer, resumed.meta, resumed.state_tensors)
        load_power_state(model, resumed.state_tensors)

    end = config.steps if stop_at is None else min(config.steps, stop_at)
    t_start = time.perf_counter()
    throughput = _Throughput()
    for step in range(start, end):
        t_step = time.perf_counter()
        lr = config.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = random_windows(corpus.train, config.batch_size, model_config.seq_len,
                              _batch_generator(config.seed, step))  # (B, N) each
        x, y = x.to(device), y.to(device)
        loss, loss_value = _loss(model, x, y, device)
        optimizer.zero_grad(set_to_none=True)
        history.observe(loss_value, config.spike_nats)
        if loss is None or not math.isfinite(loss_value):
            history.record(step + 1, loss_value, lr)
            break
        loss.backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        done = step + 1
        report = done % config.progress_every == 0 or done == end
        if report and device.type == "cuda":
            torch.cuda.synchronize(device)  # CUDA runs ahead of the host clock
        throughput.add(time.perf_counter() - t_step, x.numel())
        history.record(done, loss_value, lr)
        if report:
            tps = throughput.take()
            history.tokens_per_s.append(tps)
            if progress is not None:
                progress(Progress(done / config.steps, "training", done, config.steps,
                                  loss_value, tps))
        _after_step(model, optimizer, corpus, config, history, done, checkpoint_dir)
    steps_done = history.step[-1] if history.step else start
    if not history.diverged and steps_done == config.steps and \
            (not history.val_step or history.val_step[-1] != steps_done):
        history.val_step.append(steps_done)
        history.val_bpc.append(evaluate_bpc(model, corpus.valid, config.eval_tokens))
    return TrainResult(model, history, str(device), steps_done, time.perf_counter() - t_start)


def _after_step(model: CharTransformerLM, optimizer: torch.optim.Optimizer, corpus: CharCorpus,
                config: TrainConfig, history: History, done: int,
                checkpoint_dir: Path | None) -> None:
    """Periodic validation and checkpoints (the final validation happens after the loop)."""
    if config.eval_every and done % config.eval_every == 0 and done != config.steps:
        history.val_step.append(done)
        history.val_bpc.append(evaluate_bpc(model, corpus.valid, config.eval_tokens))
    if checkpoint_dir is not None and config.checkpoint_every \
            and done % config.checkpoint_every == 0:
        save_checkpoint(checkpoint_dir, model, optimizer, done, history, config)


__all__ = ["TrainResult", "autocast", "evaluate_bpc", "train_lm"]
