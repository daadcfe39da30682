"""Native checkpoints: one safetensors file, the architecture config as JSON in its metadata.

No pickle anywhere: safetensors holds raw tensors, the metadata is a str -> str map, and the
model is rebuilt from a registry of known kinds. Anything unexpected is a `CheckpointError`
naming the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from .attention import L2MHA, DotProductMHA
from .blocks import Transformer, TransformerBlock
from .config import (
    AttentionConfig,
    BlockConfig,
    ConfigError,
    TransformerConfig,
    config_from_dict,
    config_to_dict,
)

FORMAT = "lsa-native"
# 2: one attention vocabulary (config.ATTENTION_NAMES). Version 1 spelled untied L2 attention
# `attention="l2"` in language models and `tied=false` in Transformer configs; both still load.
FORMAT_VERSION = "2"
READABLE_VERSIONS = ("1", "2")


class CheckpointError(ValueError):
    """A checkpoint cannot be read. `field` names what is wrong (a metadata key, a config field
    or a tensor name)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelKind:
    name: str
    module_type: type[nn.Module]
    config_type: type
    build: Callable[[Any], nn.Module]


MODEL_KINDS: dict[str, ModelKind] = {}


def register_model_kind(name: str, module_type: type[nn.Module], config_type: type,
                        build: Callable[[Any], nn.Module] | None = None) -> None:
    """Make a module type saveable/loadable; its instances must carry `.config`."""
    MODEL_KINDS[name] = ModelKind(name, module_type, config_type, build or module_type)


register_model_kind("transformer", Transformer, TransformerConfig)
register_model_kind("block", TransformerBlock, BlockConfig)
register_model_kind("l2_mha", L2MHA, AttentionConfig, L2MHA.from_config)
register_model_kind("dp_mha", DotProductMHA, AttentionConfig, DotProductMHA.from_config)


def _upgrade_v1(kind: str, cfg: Any) -> Any:
    """A version-1 config in today's vocabulary (what each word meant when it was written)."""
    if not isinstance(cfg, dict):
        return cfg
    cfg = dict(cfg)
    if kind == "transformer" and "tied" in cfg:
        tied = cfg.pop("tied")
        if cfg.get("attention", "l2") == "l2" and tied is False:
            cfg["attention"] = "l2_untied"
    elif kind == "char_lm":
        # v1 language models: "l2" was the untied layer, "l2_tied" the certifiable one.
        cfg["attention"] = {"l2": "l2_untied", "l2_tied": "l2"}.get(cfg.get("attention"),
                                                                   cfg.get("attention"))
    return cfg


def _kind_of(model: nn.Module) -> ModelKind:
    for kind in MODEL_KINDS.values():
        if type(model) is kind.module_type:
            return kind
    raise CheckpointError("model", f"cannot save a {type(model).__name__}; known kinds: "
                          f"{', '.join(sorted(MODEL_KINDS))}")


def to_bytes(model: nn.Module, extra_metadata: dict[str, str] | None = None) -> bytes:
    kind = _kind_of(model)
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind.name,
        "config": json.dumps(config_to_dict(model.config), sort_keys=True),
    }
    metadata.update(extra_metadata or {})
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return st_save(tensors, metadata=metadata)


def save(model: nn.Module, path: str | os.PathLike[str],
         extra_metadata: dict[str, str] | None = None) -> Path:
    path = Path(path)
    data = to_bytes(model, extra_metadata)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # never leave a half-written checkpoint behind
    return path


def read_metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's metadata, validated to be ours."""
    if len(data) < 8:
        raise CheckpointError("file", "too short to be a safetensors file")
    header_len = int.from_bytes(data[:8], "little")
    if header_len <= 0 or header_len > len(data) - 8 or header_len > 100_000_000:
        raise CheckpointError("file", "not a safetensors file (bad header length); upload a "
                              "file written by lsa_models.save")
    try:
        header = json.loads(data[8:8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError("file", "not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError("file", "not a safetensors file (header is not an object)")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise CheckpointError("__metadata__", "missing: this safetensors file was not written "
                              "by lsa_models.save (no architecture config)")
    if meta.get("format") != FORMAT:
        raise CheckpointError("format", f"expected {FORMAT!r}, got {meta.get('format')!r}")
    version = meta.get("format_version", "1")
    if version not in READABLE_VERSIONS:
        raise CheckpointError("format_version", f"{version!r} is newer than this lsa_models "
                              f"reads ({', '.join(READABLE_VERSIONS)}); upgrade lsa")
    return {str(k): str(v) for k, v in meta.items()}


def from_bytes(data: bytes) -> nn.Module:
    meta = read_metadata(data)
    kind_name = meta.get("kind")
    if kind_name is None:
        raise CheckpointError("kind", "missing from the metadata")
    if kind_name not in MODEL_KINDS:
        raise CheckpointError("kind", f"unknown layer kind {kind_name!r}; known: "
                              f"{', '.join(sorted(MODEL_KINDS))}")
    kind = MODEL_KINDS[kind_name]
    raw = meta.get("config")
    if raw is None:
        raise CheckpointError("config", "missing from the metadata")
    try:
        cfg_dict = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError("config", f"not valid JSON ({exc.msg})") from None
    if meta.get("format_version", "1") == "1":
        cfg_dict = _upgrade_v1(kind_name, cfg_dict)
    try:
        config = config_from_dict(kind.config_type, cfg_dict)
    except ConfigError as exc:
        raise CheckpointError(f"config.{exc.field}", exc.message) from None
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointError("file", f"corrupt safetensors data: {exc}") from None
    model = kind.build(config)
    _load_state(model, tensors)
    return model.eval()


def _load_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(missing[0], "tensor missing from the checkpoint")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(unexpected[0], "unexpected tensor for this config")
    for key, ref in expected.items():
        t = tensors[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(key, f"shape {tuple(t.shape)} does not match the config's "
                                  f"{tuple(ref.shape)}")
        if not t.is_floating_point():
            raise CheckpointError(key, f"dtype {t.dtype} is not floating point")
        if not torch.isfinite(t).all():
            raise CheckpointError(key, "contains NaN or infinity")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()})


def load(path: str | os.PathLike[str]) -> nn.Module:
    return from_bytes(Path(path).read_bytes())
