"""Request bodies of POST /bound and POST /certify."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .bounds import Norm
from .training import TRAINING_EXAMPLE, TrainingSpec

MAX_SEQ_LEN = 1_000_000

SeqLenField = Field(default=None, ge=1, le=MAX_SEQ_LEN,
                    description="Sequence length N; default: the model's own (see GET /models)")
RadiusField = Field(default=None, ge=0, allow_inf_nan=False,
                    description="Bound every token's 2-norm by this radius (bounded domain); "
                    "null: all of R^{N x D}")


class EmpiricalParams(BaseModel):
    """Search for a lower bound max ||J(x)|| by gradient ascent (runs as a job)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"restarts": 4, "steps": 100, "seed": 0,
                                         "time_budget_s": 60}]},
    )

    restarts: int = Field(default=4, ge=1, le=256)
    steps: int = Field(default=100, ge=1, le=100_000)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    time_budget_s: float = Field(default=60.0, gt=0, le=24 * 3600, allow_inf_nan=False)


class BoundRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "norm": "2", "seq_len": 128},
            {"model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "norm": "inf", "seq_len": 64,
             "radius": 1.0, "empirical": {"restarts": 4, "steps": 100, "seed": 0,
                                          "time_budget_s": 60}},
        ]},
    )

    model_id: str = Field(min_length=1, max_length=64)
    norm: Norm = "2"
    seq_len: int | None = SeqLenField
    radius: float | None = RadiusField
    empirical: EmpiricalParams | None = Field(
        default=None, description="Also estimate a lower bound (202 with a job id)")


class CertifyRequest(BaseModel):
    """Certify that a stored model's Lipschitz bound is at most `max_lipschitz` (201, the
    certificate), or, with `training` instead of `model_id`, train a model and certify it
    (202, a job on the training queue)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "norm": "2",
             "max_lipschitz": 1000.0, "seq_len": 128},
            {"training": TRAINING_EXAMPLE},
        ]},
    )

    model_id: str | None = Field(default=None, min_length=1, max_length=64,
                                 description="The stored model to certify (not with training)")
    norm: Norm = "2"
    max_lipschitz: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="Threshold: passed iff the certified upper <= it (required with model_id)")
    seq_len: int | None = SeqLenField
    radius: float | None = RadiusField
    training: TrainingSpec | None = Field(
        default=None, description="Train a model and certify it instead (runs as a job; "
        "the certificate is in the 2-norm at the trained seq_len, threshold c)")

    @model_validator(mode="after")
    def _one_form(self) -> CertifyRequest:
        if self.training is not None:
            given = [name for name in ("model_id", "max_lipschitz", "seq_len", "radius")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: not allowed with training (a training "
                                 "request certifies the model it trains)")
            if self.norm != "2":
                raise ValueError("norm: a training request is certified in the 2-norm; "
                                 "omit norm or set it to '2'")
            return self
        if self.model_id is None:
            raise ValueError("model_id: required (or give a training section to train a "
                             "model first)")
        if self.max_lipschitz is None:
            raise ValueError("max_lipschitz: required with model_id")
        return self


def example_of(model: type[BaseModel]) -> dict[str, Any]:
    extra = model.model_config.get("json_schema_extra")
    assert isinstance(extra, dict)
    examples = extra["examples"]
    assert isinstance(examples, list)
    first = examples[0]
    assert isinstance(first, dict)
    return dict(first)
