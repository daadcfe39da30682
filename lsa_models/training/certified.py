"""Train, evaluate, certify and export a character-level LM in one call (`train_certified`):
the model (native safetensors and ONNX), its typed certificate and a PNG of the curves."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort
import torch
from matplotlib.figure import Figure
from torch import Tensor

from .. import checkpoint
from ..data import CharCorpus, eval_windows
from ..invertible import frozen_scales
from ..lm import CharTransformerLM, LMConfig
from .certificate import TrainingCertificate, certify_trained, json_safe
from .checkpoints import latest_checkpoint
from .config import TrainConfig, TrainingDivergedError
from .history import LN2, History, Progress, ProgressCallback
from .loop import evaluate_bpc, train_lm

# How `train_certified` splits [0, 1] between its stages.
_TRAINING_START, _TRAINING_SHARE = 0.05, 0.8


@dataclass
class TrainOutcome:
    """What `train_certified` wrote and measured."""

    model_path: Path
    onnx_path: Path
    plot_path: Path
    certificate_path: Path
    certificate: TrainingCertificate
    history: History
    wall_s: float


def export_onnx_checked(model: CharTransformerLM, path: Path, sample: Tensor) -> float:
    """ONNX export (TorchScript exporter, opset 17); returns max |logit difference| against
    torch on `sample` as checked with onnxruntime."""
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


def plot_history(history: History, path: Path, title: str) -> None:
    # A bare Figure (no pyplot): no global backend state, safe in worker threads.
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots(1, 2)
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


def _report(progress: ProgressCallback | None, fraction: float, stage: str) -> None:
    if progress is not None:
        progress(Progress(min(1.0, max(0.0, fraction)), stage))


def _training_progress(progress: ProgressCallback | None) -> ProgressCallback | None:
    """`train_lm`'s reports (fraction of the steps) placed in train_certified's range."""
    if progress is None:
        return None
    outer = progress

    def rescale(p: Progress) -> None:
        outer(Progress(_TRAINING_START + _TRAINING_SHARE * p.fraction, p.stage, p.step,
                       p.steps, p.loss, p.tokens_per_s))
    return rescale


def train_certified(model_config: LMConfig, config: TrainConfig, corpus: CharCorpus,
                    out_dir: Path, progress: ProgressCallback | None = None,
                    resume: bool = True) -> TrainOutcome:
    """Train a character-level LM, certify its trunk and write the artifacts to `out_dir`:
    `model.safetensors` (lsa_models.load), `model.onnx`, `certificate.json`, `training.png`,
    and `checkpoints/` when `config.checkpoint_every > 0` (with `resume`, a rerun in the same
    directory continues from the newest one).

    Raises `ConfigError` (bad settings), `TrainingDivergedError` (NaN/inf loss).
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out_dir / "checkpoints" if config.checkpoint_every else None
    resume_from = latest_checkpoint(ckpt_dir) if (ckpt_dir is not None and resume) else None
    _report(progress, _TRAINING_START, "training")
    result = train_lm(model_config, corpus, config, ckpt_dir, resume_from,
                      _training_progress(progress))
    history = result.history
    if history.diverged:
        raise TrainingDivergedError(f"the training loss became non-finite at step "
                                    f"{history.step[-1]}; lower lr or enable grad_clip")
    model = result.model
    _report(progress, 0.86, "evaluating")
    test_bpc = evaluate_bpc(model, corpus.test, None)
    _report(progress, 0.9, "certifying")
    cert = certify_trained(model, corpus.test, config.recon_sequences, config.inverse_atol)
    cert.test_bpc, cert.valid_bpc = test_bpc, history.val_bpc[-1]
    cert.steps, cert.divergence_events = result.steps_done, history.divergence_events

    _report(progress, 0.95, "exporting")
    model_path = checkpoint.save(model, out_dir / "model.safetensors", {
        "vocab": json.dumps(corpus.vocab.chars),
        "corpus": corpus.name,
        "certificate": json.dumps(cert.to_json(), sort_keys=True, allow_nan=False),
    })
    sample, _ = eval_windows(corpus.test, model_config.seq_len, 2 * model_config.seq_len)
    onnx_path = out_dir / "model.onnx"
    cert.onnx_max_abs_diff = export_onnx_checked(model, onnx_path, sample[:2])
    plot_path = out_dir / "training.png"
    plot_history(history, plot_path, f"{model_config.attention}, {model_config.n_layers} layers")
    tps = history.tokens_per_s
    cert.tokens_per_s = sum(tps) / len(tps) if tps else 0.0
    cert.device = result.device
    cert_path = out_dir / "certificate.json"
    body: dict[str, Any] = {**cert.to_json(), "history": json_safe(history.to_dict())}
    cert_path.write_text(json.dumps(body, indent=1, sort_keys=True, allow_nan=False))
    _report(progress, 1.0, "done")
    return TrainOutcome(model_path, onnx_path, plot_path, cert_path, cert, history,
                        time.perf_counter() - t0)


__all__ = ["TrainOutcome", "export_onnx_checked", "plot_history", "train_certified"]
