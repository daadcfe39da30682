"""Request bodies of POST /bound and POST /certify."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .bounds import Norm
from .training import TRAINING_EXAMPLE, TrainingSpec

MAX_SEQ_LEN = 1_000_000

SeqLenField = Field(default=None, ge=1, le=MAX_SEQ_LEN,
                    description="Sequence length N; default: the model's own (see GET /models)")
RadiusField = Field(default=None, ge=0, allow_inf_nan=False,
                    description="Bound every token's 2-norm by this radius (bounded domain); "
                    "null: all of R^{N x D}")


AT_SHAPES = ("one input X0 of the model's shape, as nested lists of finite numbers: (N, D), "
             "or (1, N, D) with a leading batch of 1; on an upload on pixels (GET /models: "
             "summary layout 'pixels') the image (C, H, W) or (1, C, H, W), which is cut into "
             "the patches (P, C*kh*kw) the model is analysed on")
AtField = Field(
    default=None, description=AT_SHAPES[0].upper() + AT_SHAPES[1:] + ". With it the report "
    "is local: the constant on the ball {X : ||X - X0||_norm <= eps} (`lsa bound --at`)")
EXAMPLE_AT: list[Any] = [[0.5, -1.0, 0.25, 2.0], [1.0, 0.0, -0.5, 0.75]]


def center_shape(at: list[Any], field: str = "at") -> tuple[int, ...]:
    """The shape of a nested list of numbers: (N, D), (1, N, D), or an image (C, H, W) or
    (1, C, H, W) (the model's own shape is checked once it is known); ValueError naming
    `field` and the fix for ragged, empty, non-numeric or non-finite input."""
    shape: list[int] = []
    level: Any = at
    while isinstance(level, list):
        if not level:
            raise ValueError(f"{field}: an empty list; give one input of shape (N, D)")
        shape.append(len(level))
        level = level[0]
    if len(shape) not in (2, 3, 4) or (len(shape) == 4 and shape[0] != 1):
        raise ValueError(f"{field}: shape {tuple(shape)}; give one input as (N, D) nested "
                         "lists, or (1, N, D); on a pixel upload the image (C, H, W) or "
                         "(1, C, H, W)")

    def check(node: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, bool) or not isinstance(node, int | float):
                raise ValueError(f"{field}: {node!r} is not a number")
            if not math.isfinite(node):
                raise ValueError(f"{field}: holds {node}; every entry must be finite")
            return
        if not isinstance(node, list) or len(node) != shape[depth]:
            raise ValueError(f"{field}: ragged nested lists (every row needs "
                             f"{shape[depth]} entries at depth {depth}); give a rectangular "
                             "(N, D) array")
        for child in node:
            check(child, depth + 1)

    check(at, 0)
    return tuple(shape)


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
            {"model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "norm": "2",
             "at": EXAMPLE_AT, "eps": 0.01},
        ]},
    )

    model_id: str = Field(min_length=1, max_length=64)
    norm: Norm = "2"
    seq_len: int | None = SeqLenField
    radius: float | None = RadiusField
    empirical: EmpiricalParams | None = Field(
        default=None, description="Also estimate a lower bound (202 with a job id)")
    at: list[Any] | None = AtField
    eps: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                              description="Radius of the ball around `at` in the `norm` norm "
                              "(required with at, > 0)")

    @model_validator(mode="after")
    def _local_form(self) -> BoundRequest:
        if self.at is None and self.eps is None:
            return self
        if self.at is None:
            raise ValueError("eps: only with at (the input the ball is centred on); give at "
                             "or omit eps")
        if self.eps is None:
            raise ValueError("at: needs eps, the radius (> 0) of the ball around it")
        if self.radius is not None:
            raise ValueError("radius: not with at (the ball around at is the domain); omit "
                             "radius")
        center_shape(self.at)
        return self


SET_FIELDS = ("inputs", "labels", "min_certified_accuracy")


class CertifyRequest(BaseModel):
    """Certify that a stored model's Lipschitz bound is at most `max_lipschitz` (201, the
    certificate); or, with `at`, `label` and `min_radius`, that `label` is certified robust
    on the ball of radius `min_radius` around `at` (a certificate of kind robustness: 201
    when the radii of (model, at, label, norm) are stored, else 202, a job on the bound queue
    whose result is the certificate); or, with `inputs`, `labels`, `min_radius` and
    `min_certified_accuracy`, that at least that fraction of the inputs is certified robust
    on the balls of radius `min_radius` (a certificate of kind robustness_set: 202, a job on
    the bound queue); or, with `training` instead of `model_id`, train a model and certify it
    (202, a job on the training queue). The fields present choose the kind; mixing kinds is
    422."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "norm": "2",
             "max_lipschitz": 1000.0, "seq_len": 128},
            {"training": TRAINING_EXAMPLE},
            {"model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "norm": "2",
             "at": EXAMPLE_AT, "label": 1, "min_radius": 0.01},
            {"model_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "norm": "inf",
             "inputs": [EXAMPLE_AT, EXAMPLE_AT], "labels": [1, 0], "min_radius": 0.01,
             "min_certified_accuracy": 0.5},
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
    at: list[Any] | None = Field(
        default=None, description="Robustness certificates, with label and min_radius: "
        + AT_SHAPES)
    label: int | None = Field(default=None, ge=0, description="Robustness certificates: the "
                              "class whose margins f_label - f_j must stay positive")
    min_radius: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="Robustness certificates: "
        "passed iff the certified radius (in the norm) >= min_radius (> 0: a label that is "
        "not the prediction has certified radius 0 and never passes); with inputs: the "
        "radius every input is decided at")
    inputs: list[Any] | None = Field(
        default=None, description="Certified accuracy of a set (with labels, min_radius and "
        "min_certified_accuracy; a job on the bound queue): the inputs, a list of inputs of "
        "the same shape, each " + AT_SHAPES)
    labels: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="With inputs: one class per input")
    min_certified_accuracy: float | None = Field(
        default=None, ge=0, le=1, allow_inf_nan=False, description="With inputs: passed "
        "iff the fraction of the inputs certified robust on the ball of radius min_radius "
        "is at least this")
    sweep: bool | None = Field(
        default=None, description="With inputs: false skips the radius sweep on the inputs "
        "the affine walks and the attack leave undecided (faster on attention models, where "
        "it rarely decides one; they stay unknown; the certificate records it). Default "
        "true")

    @model_validator(mode="after")
    def _one_form(self) -> CertifyRequest:
        in_set = [n for n in SET_FIELDS if getattr(self, n) is not None]
        if in_set:
            return self._set_form(in_set)
        if self.sweep is not None:
            raise ValueError("sweep: only with inputs (a certified-accuracy certificate); "
                             "omit it")
        robust = [n for n in ("at", "label", "min_radius") if getattr(self, n) is not None]
        if robust:
            return self._robustness_form(robust)
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
            raise ValueError("max_lipschitz: required with model_id (or at, label and "
                             "min_radius for a robustness certificate)")
        return self

    def _set_form(self, given: list[str]) -> CertifyRequest:
        missing = [n for n in (*SET_FIELDS, "min_radius", "model_id")
                   if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required with {', '.join(given)} (a "
                             "certified-accuracy certificate needs model_id, inputs, labels, "
                             "min_radius and min_certified_accuracy)")
        mixed = [n for n in ("max_lipschitz", "seq_len", "radius", "training", "at", "label")
                 if getattr(self, n) is not None]
        if mixed:
            raise ValueError(f"{', '.join(mixed)}: not with inputs/labels (one certificate "
                             "kind per request)")
        assert self.inputs is not None and self.labels is not None
        if not self.inputs:
            raise ValueError("inputs: an empty list; give at least one input")
        shapes = {center_shape(x, f"inputs[{i}]") for i, x in enumerate(self.inputs)}
        if len(shapes) != 1:
            raise ValueError(f"inputs: shapes {sorted(shapes)}; every input needs the same "
                             "shape")
        if len(self.labels) != len(self.inputs):
            raise ValueError(f"labels: {len(self.labels)} for {len(self.inputs)} inputs; give "
                             "one label per input")
        return self

    def _robustness_form(self, given: list[str]) -> CertifyRequest:
        missing = [n for n in ("at", "label", "min_radius") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required with {', '.join(given)} (a "
                             "robustness certificate needs at, label and min_radius)")
        mixed = [n for n in ("max_lipschitz", "seq_len", "radius", "training")
                 if getattr(self, n) is not None]
        if mixed:
            raise ValueError(f"{', '.join(mixed)}: not with at/label/min_radius (one "
                             "certificate kind per request: a Lipschitz certificate takes "
                             "max_lipschitz, a robustness one at, label, min_radius)")
        if self.model_id is None:
            raise ValueError("model_id: required for a robustness certificate")
        assert self.at is not None
        center_shape(self.at)
        return self


def example_of(model: type[BaseModel]) -> dict[str, Any]:
    extra = model.model_config.get("json_schema_extra")
    assert isinstance(extra, dict)
    examples = extra["examples"]
    assert isinstance(examples, list)
    first = examples[0]
    assert isinstance(first, dict)
    return dict(first)
