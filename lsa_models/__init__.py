"""lsa_models: attention layers, certified Lipschitz bounds, estimators, native checkpoints.

Pure torch/onnx: never imports the web, database or service layers.
"""

from .attention import L2MHA, DotProductMHA, build_attention
from .blocks import FeedForward, Transformer, TransformerBlock
from .bounds import BoundResult, LayerBound, certify
from .checkpoint import CheckpointError, from_bytes, load, register_model_kind, save, to_bytes
from .config import (
    ATTENTION_NAMES,
    AttentionConfig,
    BlockConfig,
    ConfigError,
    FFNConfig,
    TransformerConfig,
)
from .lm import CharTransformerLM, LMConfig  # registers the "char_lm" checkpoint kind

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_NAMES",
    "AttentionConfig",
    "BlockConfig",
    "BoundResult",
    "CharTransformerLM",
    "CheckpointError",
    "ConfigError",
    "DotProductMHA",
    "FFNConfig",
    "FeedForward",
    "LMConfig",
    "L2MHA",
    "LayerBound",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "__version__",
    "build_attention",
    "certify",
    "from_bytes",
    "load",
    "register_model_kind",
    "save",
    "to_bytes",
]
