"""Training character-level LMs, and the service's entry point `train_certified`.

- `train_lm`: AdamW (Adam when weight_decay = 0), optional linear warmup then cosine decay,
  or a fixed learning rate (the stability experiment), gradient clipping, bits-per-character
  evaluation, checkpoints every K steps (model and optimizer state in safetensors, the rest as
  JSON in the metadata; never pickle), exact resume, seeds, device auto-selection (CUDA with
  bf16 autocast when present) and a progress callback `(step, loss, tokens_per_s)`.
- `train_certified(request, corpus_text, out_dir, progress)`: train, evaluate, certify, and
  write the model (native safetensors and ONNX), its certificate and a PNG of the curves.

Exact resume: the batch of step t is drawn from a generator seeded by (seed, t), the learning
rate is a function of t, the model has no dropout and the optimizer state is restored
bit for bit, so on CPU a resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from . import checkpoint
from .bounds.analyzer import certify
from .data import CharCorpus, CorpusError, eval_windows, ptb_corpus, random_windows, text_corpus
from .invertible import ContractiveTrunk, NonFiniteWeightsError, frozen_scales
from .lm import LM_ATTENTION_KINDS, CharTransformerLM, LMConfig

LN2 = math.log(2.0)
StepCallback = Callable[[int, float, float], None]
ProgressCallback = Callable[[float, str, dict[str, Any]], None]


class RequestError(ValueError):
    """A training request is invalid; `field` names the offending entry."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class TrainingDivergedError(RuntimeError):
    """The training loss became NaN or infinite."""


def _int_field(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum \
            or (maximum is not None and value > maximum):
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise RequestError(name, f"must be an integer {bound}, got {value!r}")


def _float_field(name: str, value: Any, low: float, high: float | None = None,
                 open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > low if open_low else value >= low
        ok = ok and (high is None or value <= high)
    if not ok:
        rng = f"{'>' if open_low else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise RequestError(name, f"must be a finite number {rng}, got {value!r}")


def select_device(device: str = "auto") -> torch.device:
    """'auto': CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RequestError("device", "CUDA was requested but no GPU is available; use 'auto'")
    if device not in ("cpu", "cuda"):
        raise RequestError("device", f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one run (the model's shape lives in `LMConfig`)."""

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
    device: str = "auto"
    spike_nats: float = 1.0  # a loss this far above the best smoothed loss is a divergence event

    def __post_init__(self) -> None:
        _int_field("steps", self.steps, 1, 10_000_000)
        _int_field("batch_size", self.batch_size, 1, 65_536)
        _float_field("lr", self.lr, 0.0, 10.0, open_low=True)
        _int_field("warmup_steps", self.warmup_steps, 0)
        if self.fixed_lr and self.warmup_steps:
            raise RequestError("warmup_steps", "must be 0 with fixed_lr (a fixed learning rate "
                               "has no warmup)")
        if not isinstance(self.fixed_lr, bool):
            raise RequestError("fixed_lr", f"must be a boolean, got {self.fixed_lr!r}")
        _float_field("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _float_field("weight_decay", self.weight_decay, 0.0, 10.0)
        _float_field("beta1", self.beta1, 0.0, 1.0)
        _float_field("beta2", self.beta2, 0.0, 1.0)
        if self.grad_clip is not None:
            _float_field("grad_clip", self.grad_clip, 0.0, open_low=True)
        _int_field("eval_every", self.eval_every, 0)
        if self.eval_tokens is not None:
            _int_field("eval_tokens", self.eval_tokens, 1)
        _int_field("checkpoint_every", self.checkpoint_every, 0)
        _int_field("progress_every", self.progress_every, 1)
        _int_field("seed", self.seed, 0, 2**62)
        if self.device not in ("auto", "cpu", "cuda"):
            raise RequestError("device", f"unknown device {self.device!r}; use auto, cpu or cuda")
        _float_field("spike_nats", self.spike_nats, 0.0, open_low=True)

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


@dataclass
class History:
    """Per-step training loss (nats/char), learning rate, validation bpc, throughput."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val_step: list[int] = field(default_factory=list)
    val_bpc: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    divergence_events: int = 0
    diverged: bool = False  # a non-finite loss stopped the run
    # Divergence-event detector state, kept here so that it survives a resume.
    ema: float | None = None
    best_ema: float | None = None
    in_spike: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        return cls(**data)

    def observe(self, loss: float, spike_nats: float) -> None:
        """Count divergence events: a non-finite loss, or a jump of more than `spike_nats`
        above the best smoothed (EMA 0.1) loss; one event lasts until the loss comes back
        within half that margin."""
        if not math.isfinite(loss):
            self.divergence_events += 1
            self.diverged = True
            return
        if self.best_ema is not None:
            if not self.in_spike and loss > self.best_ema + spike_nats:
                self.divergence_events += 1
                self.in_spike = True
            elif self.in_spike and loss < self.best_ema + spike_nats / 2:
                self.in_spike = False
        self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        if len(self.loss) >= 20:  # skip the initial transient
            self.best_ema = self.ema if self.best_ema is None else min(self.best_ema, self.ema)


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


def _autocast(device: torch.device) -> torch.autocast:
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
            with _autocast(device):
                logits = model(xb)  # (b, N, V)
            nll = F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum")
            total += float(nll)
            count += yb.numel()
    model.train(was_training)
    return total / count / LN2


# ---- checkpoints ---------------------------------------------------------------------------

def _ckpt_paths(directory: Path, step: int) -> tuple[Path, Path]:
    stem = directory / f"step_{step:08d}"
    return stem.with_suffix(".safetensors"), Path(f"{stem}.train.safetensors")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_checkpoint(directory: Path, model: CharTransformerLM, optimizer: torch.optim.Optimizer,
                    step: int, history: History, config: TrainConfig) -> Path:
    """Model weights (loadable with `lsa_models.load`) and optimizer state, both safetensors;
    step, history and configs as JSON metadata. Returns the model file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    model_path, state_path = _ckpt_paths(directory, step)
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            if isinstance(value, Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    meta = {
        "format": "lsa-train-state",
        "step": str(step),
        "history": json.dumps(history.to_dict()),
        "train_config": json.dumps(dataclasses.asdict(config), sort_keys=True),
        "model_config": json.dumps(dataclasses.asdict(model.config), sort_keys=True),
        "param_groups": json.dumps(sd["param_groups"]),
        "state_scalars": json.dumps(scalars),
    }
    _atomic_write(state_path, st_save(tensors, metadata=meta))
    _atomic_write(model_path, checkpoint.to_bytes(model, {"train_step": str(step)}))
    return model_path


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint (model file whose train state exists) in `directory`."""
    if not directory.is_dir():
        return None
    found = []
    for p in directory.glob("step_*.safetensors"):
        digits = p.stem.removeprefix("step_")
        if not digits.isdigit():  # a .train.safetensors file or a stranger
            continue
        if _ckpt_paths(directory, int(digits))[1].exists():
            found.append(p)
    return max(found, default=None, key=lambda p: p.name)


def _read_train_state(model_path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    stem = model_path.name.removesuffix(".safetensors")
    state_path = model_path.with_name(f"{stem}.train.safetensors")
    if not state_path.exists():
        raise checkpoint.CheckpointError("train_state", f"{state_path} is missing; cannot "
                                         "resume from a model file alone")
    data = state_path.read_bytes()
    return _train_meta(data), st_load(data)


def _train_meta(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise checkpoint.CheckpointError("train_state", "not a safetensors file") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != "lsa-train-state":
        raise checkpoint.CheckpointError("format", "not an lsa training-state file")
    return {str(k): str(v) for k, v in meta.items()}


def _load_optimizer(optimizer: torch.optim.Optimizer, meta: dict[str, str],
                    tensors: dict[str, Tensor]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, extra in json.loads(meta["state_scalars"]).items():
        state.setdefault(int(idx), {}).update(extra)
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


# ---- the loop ------------------------------------------------------------------------------

def train_lm(model_config: LMConfig, corpus: CharCorpus, config: TrainConfig,
             checkpoint_dir: Path | None = None, resume_from: Path | None = None,
             on_step: StepCallback | None = None,
             stop_at: int | None = None) -> TrainResult:
    """Train from scratch (seeded) or resume from a checkpoint written by this function.

    `stop_at` ends the run after that many steps without changing the schedule (the lr still
    follows `config.steps`): how an interrupted run is simulated.
    """
    if model_config.vocab_size < corpus.vocab.size:
        raise RequestError("vocab_size", f"{model_config.vocab_size} is smaller than the "
                           f"corpus vocabulary ({corpus.vocab.size} characters)")
    device = select_device(config.device)
    torch.manual_seed(config.seed)
    model = CharTransformerLM(model_config)
    history = History()
    start = 0
    meta: dict[str, str] | None = None
    if resume_from is not None:
        loaded = checkpoint.load(resume_from)
        if not isinstance(loaded, CharTransformerLM):
            raise checkpoint.CheckpointError("kind", "the checkpoint is not a char_lm model")
        if loaded.config != model_config:
            raise RequestError("model_config", "differs from the checkpoint's; resume with the "
                               "same model shape")
        meta, opt_tensors = _read_train_state(Path(resume_from))
        saved = json.loads(meta["train_config"])
        for name, value in dataclasses.asdict(config).items():
            if name not in ("steps", "device", "progress_every") and saved.get(name) != value:
                raise RequestError(name, f"{value!r} differs from the checkpoint's "
                                   f"{saved.get(name)!r}; resume with the same settings")
        model.load_state_dict(loaded.state_dict())
        history = History.from_dict(json.loads(meta["history"]))
        start = int(meta["step"])
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "emb" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.beta1, config.beta2), foreach=False)
    if meta is not None:
        _load_optimizer(optimizer, meta, opt_tensors)

    end = config.steps if stop_at is None else min(config.steps, stop_at)
    t_start = time.perf_counter()
    train_time, tokens_since = 0.0, 0  # training steps only: evaluations are not counted
    for step in range(start, end):
        t_step = time.perf_counter()
        lr = config.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = random_windows(corpus.train, config.batch_size, model_config.seq_len,
                              _batch_generator(config.seed, step))  # (B, N) each
        x, y = x.to(device), y.to(device)
        try:
            with _autocast(device):
                logits = model(x)  # (B, N, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss_value = float(loss.detach())
        except NonFiniteWeightsError:
            loss_value = math.nan  # a contractive block cannot bound NaN weights
        optimizer.zero_grad(set_to_none=True)
        history.observe(loss_value, config.spike_nats)
        if not math.isfinite(loss_value):
            history.step.append(step + 1)
            history.loss.append(loss_value)
            history.lr.append(lr)
            break
        loss.backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        done = step + 1
        report = done % config.progress_every == 0 or done == end
        if report and device.type == "cuda":
            torch.cuda.synchronize(device)  # CUDA runs ahead of the host clock
        train_time += time.perf_counter() - t_step
        tokens_since += x.numel()
        history.step.append(done)
        history.loss.append(loss_value)
        history.lr.append(lr)
        if report:
            tps = tokens_since / max(train_time, 1e-9)  # this interval only
            train_time, tokens_since = 0.0, 0
            history.tokens_per_s.append(tps)
            if on_step is not None:
                on_step(done, loss_value, tps)
        if config.eval_every and done % config.eval_every == 0 and done != config.steps:
            history.val_step.append(done)
            history.val_bpc.append(evaluate_bpc(model, corpus.valid, config.eval_tokens))
        if checkpoint_dir is not None and config.checkpoint_every \
                and done % config.checkpoint_every == 0:
            save_checkpoint(checkpoint_dir, model, optimizer, done, history, config)
    steps_done = history.step[-1] if history.step else start
    if not history.diverged and steps_done == config.steps and \
            (not history.val_step or history.val_step[-1] != steps_done):
        history.val_step.append(steps_done)
        history.val_bpc.append(evaluate_bpc(model, corpus.valid, config.eval_tokens))
    return TrainResult(model, history, str(device), steps_done, time.perf_counter() - t_start)


# ---- the service entry point ---------------------------------------------------------------

@dataclass(frozen=True)
class TrainRequest:
    """What `POST /certify` asks for. Invalid values raise `RequestError` naming the field."""

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    seq_len: int = 64
    attention: Literal["dp", "l2", "l2_untied", "contractive_l2", "l2_tied"] = "contractive_l2"
    c: float = 0.9
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = "relu"
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 0
    fixed_lr: bool = False
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    seed: int = 0
    corpus: Literal["ptb", "text"] = "ptb"
    eval_every: int = 0
    eval_tokens: int | None = 16384
    checkpoint_every: int = 0
    recon_sequences: int = 8  # held-out test sequences for the reconstruction check
    inverse_atol: float = 1e-8  # per-block fixed-point tolerance (float64)
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self) -> None:
        if self.attention not in (*LM_ATTENTION_KINDS, "l2_tied"):
            raise RequestError("attention", f"unknown attention {self.attention!r}; use one of "
                               f"{', '.join(LM_ATTENTION_KINDS)}")
        _int_field("d_model", self.d_model, 1, 4096)
        _int_field("n_heads", self.n_heads, 1, 256)
        _int_field("n_layers", self.n_layers, 1, 64)
        _int_field("d_ff", self.d_ff, 1, 16384)
        _int_field("seq_len", self.seq_len, 2, 4096)
        _float_field("c", self.c, 0.0, open_low=True)
        if not self.c < 1.0:
            raise RequestError("c", f"must be < 1 (a contractive branch), got {self.c!r}")
        if self.corpus not in ("ptb", "text"):
            raise RequestError("corpus", f"unknown corpus {self.corpus!r}; use 'ptb' or 'text' "
                               "(an uploaded UTF-8 text)")
        _int_field("recon_sequences", self.recon_sequences, 1, 1024)
        _float_field("inverse_atol", self.inverse_atol, 0.0, open_low=True)
        try:
            self.model_config(vocab_size=1)
            self.train_config()
        except RequestError:
            raise
        except ValueError as exc:  # ConfigError names its field
            name = getattr(exc, "field", "request")
            raise RequestError(name, getattr(exc, "message", str(exc))) from None

    def model_config(self, vocab_size: int) -> LMConfig:
        return LMConfig(vocab_size, self.d_model, self.n_heads, self.n_layers, self.d_ff,
                        self.seq_len, self.attention, self.c,  # type: ignore[arg-type]  # alias l2_tied
                        self.activation)

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            steps=self.steps, batch_size=self.batch_size, lr=self.lr,
            warmup_steps=self.warmup_steps, fixed_lr=self.fixed_lr,
            weight_decay=self.weight_decay, grad_clip=self.grad_clip,
            eval_every=self.eval_every, eval_tokens=self.eval_tokens,
            checkpoint_every=self.checkpoint_every, seed=self.seed, device=self.device,
            progress_every=max(1, min(50, self.steps // 20)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainRequest:
        if not isinstance(data, dict):
            raise RequestError("request", f"expected an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(unknown[0], "unknown field")
        try:
            return cls(**data)
        except TypeError as exc:
            raise RequestError("request", str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainOutcome:
    """What `train_certified` wrote and measured. `certificate` (strict JSON: non-finite
    numbers become null) holds:

    - `norm` ("2"), `seq_len`, `attention`, `c`;
    - `trunk_verdict`, `trunk_lipschitz_upper` (certified upper bound of the trunk's Lip_2,
      from `bounds.certify`), `trunk_reason`, `method`;
    - contractive_l2: `branches` ([{name, kind, lipschitz_upper, contractive}], every
      lipschitz_upper <= c < 1), `invertible` (True), `trunk_inverse_lipschitz_upper`,
      `reconstruction` ({sequences, seq_len, dtype, converged, max_error, max_relative_error,
      max_abs_error, error_bound, bound_holds, iterations_per_block,
      predicted_iterations_per_block, atol}: the float64 inverse of held-out test sequences);
    - other kinds: `layers` (the analyser's per-layer entries), `invertible` (False),
      `invertible_reason`, `reconstruction` (None);
    - `test_bpc`, `valid_bpc`, `steps`, `divergence_events`, `onnx_max_abs_diff` (onnxruntime
      vs torch logits), `tokens_per_s` (mean over progress intervals), `device`.
    """

    model_path: Path
    onnx_path: Path
    plot_path: Path
    certificate_path: Path
    certificate: dict[str, Any]
    history: dict[str, Any]
    test_bpc: float
    valid_bpc: float
    device: str
    tokens_per_s: float
    wall_s: float


def _json_safe(value: Any) -> Any:
    """Non-finite floats -> None, so the certificate is strict JSON (PostgreSQL's jsonb and
    most parsers reject NaN and Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _emit(progress: ProgressCallback | None, fraction: float, message: str,
          details: dict[str, Any] | None = None) -> None:
    if progress is not None:
        progress(min(1.0, max(0.0, fraction)), message, details or {})


def load_corpus(request: TrainRequest, corpus_text: str | None) -> CharCorpus:
    if request.corpus == "ptb":
        return ptb_corpus()
    if corpus_text is None:
        raise RequestError("corpus_text", "corpus='text' needs the uploaded text")
    return text_corpus(corpus_text, min_split_chars=request.seq_len + 1)


def reconstruction_check(model: CharTransformerLM, data: Tensor, n_sequences: int,
                         atol: float) -> dict[str, Any]:
    """Invert the trunk (float64 copy, CPU) on held-out sequences' embeddings and compare."""
    trunk = model.trunk
    if not isinstance(trunk, ContractiveTrunk):
        raise TypeError("only a contractive trunk has a certified inverse")
    seq_len = model.config.seq_len
    x_ids, _ = eval_windows(data, seq_len)  # (W, N)
    step = max(1, x_ids.shape[0] // n_sequences)
    ids = x_ids[::step][:n_sequences]  # spread over the split
    cpu_model = CharTransformerLM(model.config)
    cpu_model.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    cpu_model.double().eval()
    with torch.no_grad():
        x = cpu_model.embed(ids)  # (S, N, D) float64
        y = cpu_model.trunk(x)
        res = cpu_model.trunk.inverse(y, atol=atol, max_iter=10_000)  # type: ignore[operator]
    err = (res.x - x).flatten(1).norm(dim=1)  # (S,)
    rel = err / x.flatten(1).norm(dim=1)
    return {
        "sequences": int(ids.shape[0]),
        "seq_len": seq_len,
        "dtype": "float64",
        "converged": bool(res.converged),
        "max_error": float(err.max()),
        "max_relative_error": float(rel.max()),
        "max_abs_error": float((res.x - x).abs().max()),
        "error_bound": float(res.error_bound),
        "bound_holds": bool(float(err.max()) <= res.error_bound),
        "iterations_per_block": [b.iterations for b in res.blocks],
        "predicted_iterations_per_block": [b.predicted_iterations for b in res.blocks],
        "atol": atol,
    }


def build_certificate(model: CharTransformerLM, corpus: CharCorpus, request: TrainRequest
                      ) -> dict[str, Any]:
    cfg = model.config
    result = certify(model.trunk, "2", cfg.seq_len)
    cert: dict[str, Any] = {
        "norm": "2",
        "seq_len": cfg.seq_len,
        "attention": cfg.attention,
        "c": cfg.c,
        "trunk_verdict": result.verdict,
        "trunk_lipschitz_upper": result.upper,
        "trunk_reason": result.reason,
        "method": result.method,
    }
    trunk = model.trunk
    if isinstance(trunk, ContractiveTrunk):
        with torch.no_grad():
            branches = []
            for i, blk in enumerate(trunk.residual_blocks()):
                lip = float(blk.lipschitz_upper(cfg.seq_len))  # type: ignore[arg-type]
                branches.append({"name": f"trunk.blocks.{i}", "kind": type(blk).__name__,
                                 "lipschitz_upper": lip, "contractive": lip <= cfg.c < 1.0})
            inv = trunk.inverse_lipschitz_upper(cfg.seq_len)
        cert["branches"] = branches
        cert["invertible"] = all(b["contractive"] for b in branches)
        cert["trunk_inverse_lipschitz_upper"] = inv
        cert["reconstruction"] = reconstruction_check(model, corpus.test,
                                                      request.recon_sequences,
                                                      request.inverse_atol)
    else:
        cert["layers"] = [{"name": lb.name, "kind": lb.kind, "lipschitz_upper": lb.upper,
                           "status": lb.status} for lb in result.layers]
        cert["invertible"] = False
        cert["invertible_reason"] = ("only attention='contractive_l2' scales its residual "
                                     "branches to a certified constant c < 1")
        cert["reconstruction"] = None
    return cert


def _export_onnx(model: CharTransformerLM, path: Path, sample: Tensor) -> float:
    """ONNX export (TorchScript exporter, opset 17); returns max |logit difference| against
    torch on `sample` as checked with onnxruntime."""
    import warnings

    import onnxruntime as ort

    cpu_model = CharTransformerLM(model.config)
    cpu_model.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    cpu_model.eval()
    with frozen_scales(cpu_model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(cpu_model, (sample,), str(path), dynamo=False, opset_version=17,
                          input_names=["tokens"], output_names=["logits"],
                          dynamic_axes={"tokens": {0: "batch"}, "logits": {0: "batch"}})
        ref = cpu_model(sample).numpy()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"tokens": sample.numpy()})[0]
    return float(abs(out - ref).max())


def _plot(history: History, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    train_bpc = [v / LN2 for v in history.loss]
    ax[0].plot(history.step, train_bpc, lw=0.8, label="train (per batch)")
    if history.val_step:
        ax[0].plot(history.val_step, history.val_bpc, "o-", label="validation")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("bits per character")
    ax[0].legend()
    ax[0].set_title(title)
    ax[1].plot(history.step, history.lr, lw=0.8)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("learning rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train_certified(request: TrainRequest, corpus_text: str | None, out_dir: Path,
                    progress: ProgressCallback | None = None,
                    resume: bool = True) -> TrainOutcome:
    """Train a character-level LM, certify its trunk and write the artifacts to `out_dir`:
    `model.safetensors` (lsa_models.load), `model.onnx`, `certificate.json`, `training.png`,
    and `checkpoints/` when `request.checkpoint_every > 0` (with `resume`, a rerun in the same
    directory continues from the newest one).

    `progress(fraction, message, details)`: fraction in [0, 1]; details of training steps carry
    step, loss (nats/char) and tokens_per_s. Raises `RequestError` (bad request or corpus),
    `TrainingDivergedError` (NaN/inf loss), `CorpusError` for unusable text.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _emit(progress, 0.0, "loading corpus", {"corpus": request.corpus})
    try:
        corpus = load_corpus(request, corpus_text)
    except CorpusError as exc:
        raise RequestError("corpus_text" if request.corpus == "text" else "corpus",
                           str(exc)) from None
    model_config = request.model_config(corpus.vocab.size)
    train_cfg = request.train_config()
    ckpt_dir = out_dir / "checkpoints" if request.checkpoint_every else None
    resume_from = latest_checkpoint(ckpt_dir) if (ckpt_dir is not None and resume) else None

    def on_step(step: int, loss: float, tps: float) -> None:
        _emit(progress, 0.05 + 0.8 * step / request.steps, "training",
              {"step": step, "steps": request.steps, "loss": loss, "bpc": loss / LN2,
               "tokens_per_s": tps})

    result = train_lm(model_config, corpus, train_cfg, ckpt_dir, resume_from, on_step)
    history = result.history
    if history.diverged:
        raise TrainingDivergedError(f"the training loss became non-finite at step "
                                    f"{history.step[-1]}; lower lr or enable grad_clip")
    model = result.model
    _emit(progress, 0.86, "evaluating", {})
    test_bpc = evaluate_bpc(model, corpus.test, None)
    valid_bpc = history.val_bpc[-1]
    _emit(progress, 0.9, "certifying", {})
    cert = build_certificate(model, corpus, request)
    cert["test_bpc"] = test_bpc
    cert["valid_bpc"] = valid_bpc
    cert["steps"] = result.steps_done
    cert["divergence_events"] = history.divergence_events

    _emit(progress, 0.95, "exporting", {})
    model_path = checkpoint.save(model, out_dir / "model.safetensors", {
        "vocab": json.dumps(corpus.vocab.chars),
        "corpus": corpus.name,
        "certificate": json.dumps(_json_safe(cert), sort_keys=True, allow_nan=False),
    })
    sample, _ = eval_windows(corpus.test, model_config.seq_len, 2 * model_config.seq_len)
    onnx_path = out_dir / "model.onnx"
    cert["onnx_max_abs_diff"] = _export_onnx(model, onnx_path, sample[:2])
    plot_path = out_dir / "training.png"
    _plot(history, plot_path, f"{request.attention}, {request.n_layers} layers")
    tps = (sum(history.tokens_per_s) / len(history.tokens_per_s)) if history.tokens_per_s else 0.0
    cert["tokens_per_s"] = tps
    cert["device"] = result.device
    cert = _json_safe(cert)
    hist = _json_safe(history.to_dict())
    cert_path = out_dir / "certificate.json"
    cert_path.write_text(json.dumps({**cert, "history": hist}, indent=1, sort_keys=True,
                                    allow_nan=False))
    _emit(progress, 1.0, "done", {"test_bpc": test_bpc})
    return TrainOutcome(model_path, onnx_path, plot_path, cert_path, cert, hist,
                        test_bpc, valid_bpc, result.device, tps, time.perf_counter() - t0)


__all__ = [
    "History",
    "RequestError",
    "TrainConfig",
    "TrainOutcome",
    "TrainRequest",
    "TrainResult",
    "TrainingDivergedError",
    "build_certificate",
    "evaluate_bpc",
    "latest_checkpoint",
    "save_checkpoint",
    "select_device",
    "train_certified",
    "train_lm",
]
