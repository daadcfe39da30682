"""Training requests (the training form of POST /certify), uploaded corpora, and what a
training job returns. The limits here are the wire's; the service maps a `TrainingSpec` to
the library's configs (`service.training.training_configs`: `lsa_models.lm.LMConfig` and
`lsa_models.training.TrainConfig`), which re-check every value (and cross-field rules such as
d_model % n_heads) before a job is queued."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The library's vocabulary (lsa_models.config.ATTENTION_NAMES; a test keeps them equal), plus
# `l2_tied`, the deprecated name of `l2`.
AttentionKind = Literal["dp", "l2", "l2_untied", "contractive_l2", "l2_tied"]

TRAINING_EXAMPLE: dict[str, Any] = {
    "d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 256, "seq_len": 64,
    "attention": "contractive_l2", "c": 0.9, "steps": 2000, "batch_size": 32, "lr": 0.001,
    "seed": 0, "corpus": "ptb",
}


class TrainingSpec(BaseModel):
    """Train a character-level Transformer LM and certify it. With attention
    `contractive_l2` every residual branch is scaled to a certified Lipschitz constant
    <= c < 1, so the trunk is invertible (certified); other kinds train and get their trunk's
    certified bound, without an invertibility claim."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            TRAINING_EXAMPLE,
            {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "seq_len": 16,
             "attention": "contractive_l2", "c": 0.5, "steps": 20, "batch_size": 8,
             "corpus": "3f1c2a10-8d0c-4b53-9d5e-2f6b1f1c2a10"},
        ]},
    )

    d_model: int = Field(default=64, ge=1, le=4096, description="Token width D")
    n_heads: int = Field(default=4, ge=1, le=256, description="Attention heads (divide d_model)")
    n_layers: int = Field(default=2, ge=1, le=64, description="Transformer layers")
    d_ff: int = Field(default=256, ge=1, le=16384, description="Feed-forward hidden width")
    seq_len: int = Field(default=64, ge=2, le=4096, description="Context length N (characters)")
    attention: AttentionKind = Field(
        default="contractive_l2",
        description="dp | l2 (tied L2, certifiable: Theorem 3.2) | l2_untied (not "
                    "certifiable) | contractive_l2 (certified invertible); l2_tied: the old "
                    "name of l2 (deprecated)")
    c: float = Field(default=0.9, gt=0, lt=1, allow_inf_nan=False,
                     description="Contraction constant of every residual branch (< 1)")
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = "relu"
    steps: int = Field(default=1000, ge=1,
                       description="Optimizer steps (at most LSA_MAX_TRAINING_STEPS)")
    batch_size: int = Field(default=32, ge=1, le=65_536)
    lr: float = Field(default=1e-3, gt=0, le=10, allow_inf_nan=False)
    warmup_steps: int = Field(default=0, ge=0)
    fixed_lr: bool = Field(default=False, description="Constant learning rate (no warmup, decay)")
    weight_decay: float = Field(default=0.01, ge=0, le=10, allow_inf_nan=False)
    grad_clip: float | None = Field(default=1.0, gt=0, allow_inf_nan=False,
                                    description="Max global gradient norm; null: no clipping")
    seed: int = Field(default=0, ge=0, le=2**62)
    corpus: str = Field(default="ptb", min_length=1, max_length=64,
                        description="'ptb' (Penn Treebank, characters) or the id of a text "
                                    "uploaded with POST /corpora")
    eval_every: int = Field(default=0, ge=0, description="Validate every K steps; 0: at the end")
    eval_tokens: int | None = Field(default=16384, ge=1,
                                    description="Validation characters per evaluation; "
                                                "null: the whole split")
    checkpoint_every: int = Field(default=0, ge=0,
                                  description="Checkpoint every K steps (a restarted job "
                                              "resumes from the newest); 0: none")
    recon_sequences: int = Field(default=8, ge=1, le=1024,
                                 description="Held-out sequences the certified inverse "
                                             "reconstructs")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: CUDA when the worker has it")


class CorpusOut(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "id": "3f1c2a10-8d0c-4b53-9d5e-2f6b1f1c2a10", "sha256": "5e8a" + "0" * 60,
        "filename": "shakespeare.txt", "size_bytes": 1115394, "chars": 1115394,
        "vocab_size": 65, "created_at": "2026-12-02T12:00:00Z"}]})

    id: str = Field(description="Name it as `training.corpus` in POST /certify")
    sha256: str = Field(description="sha256 of the uploaded bytes")
    filename: str
    size_bytes: int
    chars: int = Field(description="Characters (Unicode code points) in the text")
    vocab_size: int = Field(description="Distinct characters")
    created_at: datetime


class ArtifactLink(BaseModel):
    sha256: str
    url: str = Field(description="Where to download it (relative to the API root)")


TRAINING_RESULT_EXAMPLE: dict[str, Any] = {
    "model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
    "certificate_id": "c0ffee00-0000-5000-8000-000000000001",
    "certificate_url": "/certificates/c0ffee00-0000-5000-8000-000000000001",
    "artifacts": {
        "model": {"sha256": "9f2c" + "0" * 60,
                  "url": "/models/1b4e28ba-2fa1-11d2-883f-0016d3cca427/file"},
        "onnx": {"sha256": "a1b2" + "0" * 60, "url": "/artifacts/a1b2" + "0" * 60},
        "plot": {"sha256": "c3d4" + "0" * 60, "url": "/artifacts/c3d4" + "0" * 60},
    },
    "invertible": True, "c": 0.9, "max_branch_lipschitz": 0.8999,
    "trunk_lipschitz_upper": 13.03, "reconstruction_max_error": 2.6e-10, "test_bpc": 1.52,
    "valid_bpc": 1.55, "steps": 2000, "device": "cuda", "tokens_per_s": 412000.0,
    "wall_s": 95.2,
}


class TrainingResult(BaseModel):
    """The `result` of a succeeded training job (GET /jobs/{id})."""

    model_config = ConfigDict(extra="forbid",
                              json_schema_extra={"examples": [TRAINING_RESULT_EXAMPLE]})

    model_id: str = Field(description="The trained model (GET /models/{id}, POST /bound)")
    certificate_id: str = Field(description="Its signed certificate (GET /certificates/{id})")
    certificate_url: str
    artifacts: dict[str, ArtifactLink] = Field(
        description="model (native safetensors), onnx (export), plot (PNG training curves)")
    invertible: bool = Field(description="Every residual branch certified <= c < 1")
    c: float
    max_branch_lipschitz: float | None = Field(
        description="Largest certified branch constant (contractive_l2 only)")
    trunk_lipschitz_upper: float | None = Field(description="Certified Lip_2 of the trunk")
    reconstruction_max_error: float | None = Field(
        description="Largest ||inverse(f(x)) - x|| on held-out sequences (float64)")
    test_bpc: float | None = Field(description="Test bits per character")
    valid_bpc: float | None
    steps: int
    device: str
    tokens_per_s: float
    wall_s: float
