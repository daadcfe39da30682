"""Training checkpoints: the model (a native checkpoint, loadable with `lsa_models.load`) and
the optimizer state (safetensors), with step, history and configs as JSON metadata. Never
pickle."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .. import checkpoint
from ..invertible.estimate import load_power_vectors, power_vectors
from ..lm import CharTransformerLM
from .config import TrainConfig
from .history import History

TRAIN_STATE_FORMAT = "lsa-train-state"


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
    # The contractive blocks' warm-start vectors: training state, not weights.
    for key, value in power_vectors(model).items():
        tensors[f"power.{key}"] = value.detach().contiguous().cpu()
    meta = {
        "format": TRAIN_STATE_FORMAT,
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


def read_train_state(model_path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """The metadata and tensors (optimizer `state.*`, warm-start `power.*`) saved next to a
    checkpoint's model file."""
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
    if not isinstance(meta, dict) or meta.get("format") != TRAIN_STATE_FORMAT:
        raise checkpoint.CheckpointError("format", "not an lsa training-state file")
    return {str(k): str(v) for k, v in meta.items()}


def load_optimizer_state(optimizer: torch.optim.Optimizer, meta: dict[str, str],
                         tensors: dict[str, Tensor]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if not key.startswith("state."):
            continue  # `power.*`: see load_power_state
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, extra in json.loads(meta["state_scalars"]).items():
        state.setdefault(int(idx), {}).update(extra)
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


def load_power_state(model: CharTransformerLM, tensors: dict[str, Tensor]) -> None:
    """The warm-start vectors `save_checkpoint` stored (none in older files: a cold start)."""
    load_power_vectors(model, {k.removeprefix("power."): v for k, v in tensors.items()
                               if k.startswith("power.")})


__all__ = ["latest_checkpoint", "load_optimizer_state", "load_power_state", "read_train_state",
           "save_checkpoint"]
