"""Request bodies of POST /bound and POST /certify: each a union of shapes told apart by
`kind` (OpenAPI: `oneOf` with a discriminator), every shape with its own required fields.

A body without `kind` is still taken (deprecated, for one minor version): it is read by the
old one-object schemas (`LegacyBoundRequest`, `LegacyCertifyRequest`, whose error messages
it keeps), which infer the kind from the fields present as before; `BoundRequest.inferred`
and `CertifyRequest.inferred` say so, and the routes answer with a `Deprecation` header.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    RootModel,
    model_validator,
)

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


class LegacyBoundRequest(BaseModel):
    """POST /bound without `kind` (deprecated): the kind is inferred from the fields."""

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
    def _local_form(self) -> LegacyBoundRequest:
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


class LegacyCertifyRequest(BaseModel):
    """POST /certify without `kind` (deprecated): the kind is inferred from the fields. A
    Lipschitz certificate with `max_lipschitz`; a robustness one with `at`, `label` and
    `min_radius`; a certified-accuracy one with `inputs`, `labels`, `min_radius` and
    `min_certified_accuracy`; with `training` instead of `model_id`, train a model and certify
    it. Mixing kinds is 422."""

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
    time_budget_s: float | None = Field(
        default=None, gt=0, le=24 * 3600, allow_inf_nan=False, description="With at or "
        "inputs: seconds per input (null: no budget; omitted: the kind's default), as "
        "time_budget_s of the robustness and certified_accuracy kinds")

    @model_validator(mode="after")
    def _one_form(self) -> LegacyCertifyRequest:
        in_set = [n for n in SET_FIELDS if getattr(self, n) is not None]
        if in_set:
            return self._set_form(in_set)
        if self.sweep is not None:
            raise ValueError("sweep: only with inputs (a certified-accuracy certificate); "
                             "omit it")
        robust = [n for n in ("at", "label", "min_radius") if getattr(self, n) is not None]
        if robust:
            return self._robustness_form(robust)
        if "time_budget_s" in self.model_fields_set:
            raise ValueError("time_budget_s: only with at, label and min_radius or with "
                             "inputs (a robustness or certified-accuracy certificate); omit it")
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

    def _set_form(self, given: list[str]) -> LegacyCertifyRequest:
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
        check_set(self.inputs, self.labels)
        return self

    def _robustness_form(self, given: list[str]) -> LegacyCertifyRequest:
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


# ---- the explicit request kinds --------------------------------------------------------------

EXAMPLE_MODEL_ID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
ModelIdField = Field(min_length=1, max_length=64,
                     description="The stored model (POST /models returns its id; GET /models "
                     "lists them)")
EpsField = Field(gt=0, allow_inf_nan=False,
                 description="Radius (> 0) of the ball around `at` in the `norm` norm")
MinRadiusField = Field(gt=0, allow_inf_nan=False, description="The radius of the ball (in "
                       "the norm): passed iff the certified radius >= min_radius (> 0: a "
                       "label that is not the prediction has certified radius 0 and never "
                       "passes)")
LabelsField = Field(description="One class per input")
# The default time budgets, seconds per input (docs/cli.md, "Time budgets", for why these):
# deciding one input at a radius (a set's inputs, `lsa robustness --radius`) and searching
# one input's largest certified radius (`lsa robustness --at --label`)
DEFAULT_DECIDE_BUDGET_S = 5.0
DEFAULT_RADIUS_BUDGET_S = 60.0
MAX_TIME_BUDGET_S = 24 * 3600.0


def _budget_field(default: float, what: str) -> Any:
    return Field(
        default=default, gt=0, le=MAX_TIME_BUDGET_S, allow_inf_nan=False,
        description=f"Seconds {what} may take (> 0; null: no budget), looked at between "
        "the steps of the search (a step that has started finishes): once spent, the "
        "answer is the best proven so far with stopped_by_budget (sound, maybe not the "
        f"tightest). Default {default:g}")
EXAMPLE_EMPIRICAL = {"restarts": 4, "steps": 100, "seed": 0, "time_budget_s": 60}


def _examples(*examples: dict[str, Any]) -> ConfigDict:
    return ConfigDict(extra="forbid", json_schema_extra={"examples": list(examples)})


class GlobalBoundRequest(BaseModel):
    """The certified Lipschitz upper bound on all of R^{N x D} (or the tokens' ball of
    `radius`): 200, the report."""

    model_config = _examples({"kind": "global", "model_id": EXAMPLE_MODEL_ID, "norm": "2",
                              "seq_len": 128})

    kind: Literal["global"]
    model_id: str = ModelIdField
    norm: Norm = "2"
    seq_len: int | None = SeqLenField
    radius: float | None = RadiusField


class EmpiricalBoundRequest(BaseModel):
    """The certified upper bound and an empirical lower bound (gradient ascent): 202, a job
    whose result is the report (200 when it is stored)."""

    model_config = _examples({"kind": "empirical", "model_id": EXAMPLE_MODEL_ID,
                              "norm": "inf", "seq_len": 64, "radius": 1.0,
                              "empirical": EXAMPLE_EMPIRICAL})

    kind: Literal["empirical"]
    model_id: str = ModelIdField
    norm: Norm = "2"
    seq_len: int | None = SeqLenField
    radius: float | None = RadiusField
    empirical: EmpiricalParams = Field(description="The lower bound's search")


class LocalBoundRequest(BaseModel):
    """The local bound on the ball {X : ||X - X0||_norm <= eps} around one input (`lsa bound
    --at`): 200, the report; with `empirical`, the in-ball lower bound too (202, a job)."""

    model_config = _examples({"kind": "local", "model_id": EXAMPLE_MODEL_ID, "norm": "2",
                              "at": EXAMPLE_AT, "eps": 0.01})

    kind: Literal["local"]
    model_id: str = ModelIdField
    norm: Norm = "2"
    at: list[Any] = Field(description=AT_SHAPES[0].upper() + AT_SHAPES[1:])
    eps: float = EpsField
    seq_len: int | None = Field(default=None, ge=1, le=MAX_SEQ_LEN,
                                description="N, if given, must be the N of `at`")
    empirical: EmpiricalParams | None = Field(
        default=None, description="Also search the ball for a lower bound (202, a job)")

    @model_validator(mode="after")
    def _center(self) -> LocalBoundRequest:
        center_shape(self.at)
        return self


BoundKind = Annotated[GlobalBoundRequest | LocalBoundRequest | EmpiricalBoundRequest,
                      Field(discriminator="kind")]


class LipschitzRequest(BaseModel):
    """Is the stored model's certified Lipschitz bound at most max_lipschitz? 201, the
    certificate."""

    model_config = _examples({"kind": "lipschitz", "model_id": EXAMPLE_MODEL_ID, "norm": "2",
                              "max_lipschitz": 1000.0, "seq_len": 128})

    kind: Literal["lipschitz"]
    model_id: str = ModelIdField
    norm: Norm = "2"
    max_lipschitz: float = Field(gt=0, allow_inf_nan=False, description="Threshold: passed "
                                 "iff the certified upper bound <= it")
    seq_len: int | None = SeqLenField
    radius: float | None = RadiusField


class RobustnessRequest(BaseModel):
    """Is `label` certified robust on the ball of radius min_radius around `at`? 201 when the
    radii of (model, at, label, norm) are stored, else 202: a job on the bound queue whose
    result is the certificate."""

    model_config = _examples({"kind": "robustness", "model_id": EXAMPLE_MODEL_ID,
                              "norm": "2", "at": EXAMPLE_AT, "label": 1, "min_radius": 0.01})

    kind: Literal["robustness"]
    model_id: str = ModelIdField
    norm: Norm = "2"
    at: list[Any] = Field(description=AT_SHAPES[0].upper() + AT_SHAPES[1:])
    label: int = Field(ge=0, description="The class whose margins f_label - f_j must stay "
                       "positive")
    min_radius: float = MinRadiusField
    time_budget_s: float | None = _budget_field(DEFAULT_RADIUS_BUDGET_S,
                                                "the search of the certified radius")

    @model_validator(mode="after")
    def _center(self) -> RobustnessRequest:
        center_shape(self.at)
        return self


class CertifiedAccuracyRequest(BaseModel):
    """Is at least min_certified_accuracy of the inputs certified robust on the balls of
    radius min_radius? 201 when the verdicts are stored, else 202: a job on the bound queue
    whose result is the certificate."""

    model_config = _examples({"kind": "certified_accuracy", "model_id": EXAMPLE_MODEL_ID,
                              "norm": "inf", "inputs": [EXAMPLE_AT, EXAMPLE_AT],
                              "labels": [1, 0], "min_radius": 0.01,
                              "min_certified_accuracy": 0.5})

    kind: Literal["certified_accuracy"]
    model_id: str = ModelIdField
    norm: Norm = "2"
    inputs: list[Any] = Field(description="The inputs, all of one shape, each " + AT_SHAPES)
    labels: list[Annotated[int, Field(ge=0)]] = LabelsField
    min_radius: float = Field(gt=0, allow_inf_nan=False,
                              description="The radius every input is decided at")
    min_certified_accuracy: float = Field(
        ge=0, le=1, allow_inf_nan=False, description="Passed iff the fraction of the inputs "
        "certified robust on the ball of radius min_radius is at least this")
    sweep: bool = Field(
        default=True, description="false skips the radius sweep on the inputs the affine "
        "walks and the attack leave undecided (faster on attention models, where it rarely "
        "decides one; they stay unknown; the certificate records it)")
    time_budget_s: float | None = _budget_field(DEFAULT_DECIDE_BUDGET_S,
                                                "each input's verdict")

    @model_validator(mode="after")
    def _set(self) -> CertifiedAccuracyRequest:
        check_set(self.inputs, self.labels)
        return self


class TrainingRequest(BaseModel):
    """Train a model and certify it: 202, a job on the training queue (the certificate is in
    the 2-norm at the trained seq_len, threshold c)."""

    model_config = _examples({"kind": "training", "training": TRAINING_EXAMPLE})

    kind: Literal["training"]
    training: TrainingSpec


CertifyKind = Annotated[LipschitzRequest | RobustnessRequest | CertifiedAccuracyRequest
                        | TrainingRequest, Field(discriminator="kind")]


def check_set(inputs: list[Any], labels: list[int]) -> None:
    """ValueError naming the field for an empty set, inputs of several shapes, or a label
    count that is not the inputs'."""
    if not inputs:
        raise ValueError("inputs: an empty list; give at least one input")
    shapes = {center_shape(x, f"inputs[{i}]") for i, x in enumerate(inputs)}
    if len(shapes) != 1:
        raise ValueError(f"inputs: shapes {sorted(shapes)}; every input needs the same "
                         "shape")
    if len(labels) != len(inputs):
        raise ValueError(f"labels: {len(labels)} for {len(inputs)} inputs; give one label "
                         "per input")


def bound_kind_of(old: LegacyBoundRequest) -> dict[str, Any]:
    """A body without `kind` as the explicit shape it was inferred to be."""
    common = {"model_id": old.model_id, "norm": old.norm, "seq_len": old.seq_len}
    empirical = None if old.empirical is None else old.empirical.model_dump()
    if old.at is not None:
        return {"kind": "local", **common, "at": old.at, "eps": old.eps,
                "empirical": empirical}
    if empirical is not None:
        return {"kind": "empirical", **common, "radius": old.radius, "empirical": empirical}
    return {"kind": "global", **common, "radius": old.radius}


def certify_kind_of(old: LegacyCertifyRequest) -> dict[str, Any]:
    """A body without `kind` as the explicit shape it was inferred to be (the legacy schema's
    validator has checked that its fields make exactly one)."""
    if old.training is not None:
        return {"kind": "training", "training": old.training.model_dump()}
    common = {"model_id": old.model_id, "norm": old.norm}
    # given (null too: no budget), else the kind's default
    budget = {"time_budget_s": old.time_budget_s} if "time_budget_s" in old.model_fields_set \
        else {}
    if old.inputs is not None:
        return {"kind": "certified_accuracy", **common, "inputs": old.inputs,
                "labels": old.labels, "min_radius": old.min_radius,
                "min_certified_accuracy": old.min_certified_accuracy,
                "sweep": old.sweep is not False, **budget}
    if old.at is not None:
        return {"kind": "robustness", **common, "at": old.at, "label": old.label,
                "min_radius": old.min_radius, **budget}
    return {"kind": "lipschitz", **common, "max_lipschitz": old.max_lipschitz,
            "seq_len": old.seq_len, "radius": old.radius}


class BoundRequest(RootModel[BoundKind]):
    """POST /bound: `kind` global, local or empirical."""

    _inferred: str | None = PrivateAttr(default=None)

    @property
    def inferred(self) -> str | None:
        """The kind a body without `kind` (deprecated) was read as; None when it named one."""
        return self._inferred

    model_config = ConfigDict(json_schema_extra={"examples": [
        GlobalBoundRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore
        LocalBoundRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore
        EmpiricalBoundRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore
    ]})

    @model_validator(mode="wrap")
    @classmethod
    def _legacy(cls, data: Any, handler: ModelWrapValidatorHandler[BoundRequest]
                ) -> BoundRequest:
        if not (isinstance(data, dict) and "kind" not in data):
            return handler(data)
        explicit = bound_kind_of(LegacyBoundRequest.model_validate(data))
        req = handler(explicit)
        req._inferred = str(explicit["kind"])
        return req


class CertifyRequest(RootModel[CertifyKind]):
    """POST /certify: `kind` lipschitz, robustness, certified_accuracy or training."""

    _inferred: str | None = PrivateAttr(default=None)

    @property
    def inferred(self) -> str | None:
        """The kind a body without `kind` (deprecated) was read as; None when it named one."""
        return self._inferred

    model_config = ConfigDict(json_schema_extra={"examples": [
        LipschitzRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore
        RobustnessRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore
        CertifiedAccuracyRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore
        TrainingRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore
    ]})

    @model_validator(mode="wrap")
    @classmethod
    def _legacy(cls, data: Any, handler: ModelWrapValidatorHandler[CertifyRequest]
                ) -> CertifyRequest:
        if not (isinstance(data, dict) and "kind" not in data):
            return handler(data)
        explicit = certify_kind_of(LegacyCertifyRequest.model_validate(data))
        req = handler(explicit)
        req._inferred = str(explicit["kind"])
        return req


def example_of(model: type[BaseModel]) -> dict[str, Any]:
    extra = model.model_config.get("json_schema_extra")
    assert isinstance(extra, dict)
    examples = extra["examples"]
    assert isinstance(examples, list)
    first = examples[0]
    assert isinstance(first, dict)
    return dict(first)
