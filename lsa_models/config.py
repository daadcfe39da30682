"""Frozen architecture configs. A config plus a state dict is a whole model: checkpoints store
exactly these as JSON, so every field must be JSON-representable and validated on creation."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Literal

# The layer-level kind stored in `AttentionConfig` (checkpoints of single layers and blocks).
AttentionKind = Literal["dp", "l2"]
Activation = Literal["relu", "gelu", "tanh", "sigmoid"]

ATTENTION_KINDS: tuple[str, ...] = ("dp", "l2")
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "tanh", "sigmoid")

# The one attention vocabulary of the library, the CLI, the REST schemas and training requests:
# - `dp`: dot-product attention (no Lipschitz constant on an unbounded domain, Theorem 3.1);
# - `l2`: L2 attention with tied query/key weights, the certifiable one (Theorem 3.2);
# - `l2_untied`: L2 attention with separate key weights (trains, but no certificate);
# - `contractive_l2`: the certified invertible trunk (`invertible.ContractiveTrunk`).
AttentionName = Literal["dp", "l2", "l2_untied", "contractive_l2"]
ATTENTION_NAMES: tuple[str, ...] = ("dp", "l2", "l2_untied", "contractive_l2")
# Old words still accepted (with a DeprecationWarning) and what they mean now.
ATTENTION_ALIASES: dict[str, str] = {"l2_tied": "l2"}


class ConfigError(ValueError):
    """An architecture config is inconsistent. `field` names the offending entry."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def attention_name(word: Any, field_name: str = "attention",
                   allowed: tuple[str, ...] = ATTENTION_NAMES) -> str:
    """The canonical attention word for `word` (an alias is translated, with a warning)."""
    if isinstance(word, str) and word in ATTENTION_ALIASES:
        new = ATTENTION_ALIASES[word]
        warnings.warn(f"{field_name}={word!r} is deprecated: it is now spelled {new!r}",
                      DeprecationWarning, stacklevel=3)
        word = new
    if not isinstance(word, str) or word not in allowed:
        raise ConfigError(field_name, f"unknown attention {word!r}; use one of "
                          f"{', '.join(allowed)} ({_ALIAS_NOTE})")
    return word


_ALIAS_NOTE = "l2 is tied L2 attention, the certifiable one; l2_tied is its old name"


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class AttentionConfig:
    d_model: int
    n_heads: int
    kind: AttentionKind = "l2"
    tied: bool = True
    causal: bool = False

    def __post_init__(self) -> None:
        _positive_int("d_model", self.d_model)
        _positive_int("n_heads", self.n_heads)
        if self.kind not in ATTENTION_KINDS:
            raise ConfigError("kind", f"unknown attention kind {self.kind!r}; use one of "
                              f"{', '.join(ATTENTION_KINDS)}")
        if self.d_model % self.n_heads != 0:
            raise ConfigError("n_heads", f"d_model={self.d_model} is not divisible by "
                              f"n_heads={self.n_heads}")
        if not isinstance(self.tied, bool):
            raise ConfigError("tied", f"must be a boolean, got {self.tied!r}")
        if not isinstance(self.causal, bool):
            raise ConfigError("causal", f"must be a boolean, got {self.causal!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class FFNConfig:
    d_model: int
    d_ff: int
    activation: Activation = "gelu"

    def __post_init__(self) -> None:
        _positive_int("d_model", self.d_model)
        _positive_int("d_ff", self.d_ff)
        if self.activation not in ACTIVATIONS:
            raise ConfigError("activation", f"unknown activation {self.activation!r}; use one "
                              f"of {', '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class BlockConfig:
    attention: AttentionConfig
    ffn: FFNConfig
    norm_first: bool = True
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.attention.d_model != self.ffn.d_model:
            raise ConfigError("ffn.d_model", f"{self.ffn.d_model} differs from "
                              f"attention.d_model={self.attention.d_model}")
        if not isinstance(self.ln_eps, (int, float)) or not self.ln_eps > 0:
            raise ConfigError("ln_eps", f"must be > 0 (LayerNorm is not Lipschitz with eps=0), "
                              f"got {self.ln_eps!r}")

    @property
    def d_model(self) -> int:
        return self.attention.d_model


@dataclass(frozen=True)
class TransformerConfig:
    """A stack of identical-shape blocks mapping (B, N, D) -> (B, N, D)."""

    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    attention: Literal["dp", "l2", "l2_untied"] = "l2"  # the vocabulary of ATTENTION_NAMES
    causal: bool = False
    activation: Activation = "gelu"
    norm_first: bool = True
    ln_eps: float = 1e-5
    final_norm: bool = False

    def __post_init__(self) -> None:
        _positive_int("n_layers", self.n_layers)
        word = attention_name(self.attention, allowed=("dp", "l2", "l2_untied"))
        object.__setattr__(self, "attention", word)  # frozen: the canonical word is stored
        self.block()  # validates the shared fields

    def block(self) -> BlockConfig:
        kind: AttentionKind = "dp" if self.attention == "dp" else "l2"
        return BlockConfig(
            attention=AttentionConfig(self.d_model, self.n_heads, kind,
                                      tied=self.attention != "l2_untied", causal=self.causal),
            ffn=FFNConfig(self.d_model, self.d_ff, self.activation),
            norm_first=self.norm_first,
            ln_eps=self.ln_eps,
        )


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Rebuild a (possibly nested) frozen config, naming the field that is wrong."""
    if not isinstance(data, dict):
        raise ConfigError(prefix or "config", f"expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}", f"unknown field for {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{prefix}{name}", "missing")
            continue
        value = data[name]
        if isinstance(f.type, str) and f.type in _NESTED:
            value = config_from_dict(_NESTED[f.type], value, prefix=f"{prefix}{name}.")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc.field}", exc.message) from None
    except TypeError as exc:
        raise ConfigError(prefix or "config", str(exc)) from None


_NESTED: dict[str, type] = {
    "AttentionConfig": AttentionConfig,
    "FFNConfig": FFNConfig,
}

__all__ = [
    "ATTENTION_ALIASES",
    "ATTENTION_NAMES",
    "AttentionConfig",
    "AttentionName",
    "BlockConfig",
    "ConfigError",
    "FFNConfig",
    "TransformerConfig",
    "attention_name",
    "config_from_dict",
    "config_to_dict",
]
