"""The bound report: the one object `lsa bound --json` prints and `POST /bound` returns."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Norm = Literal["2", "inf"]
Verdict = Literal["certified", "not_lipschitz", "not_certified"]


class LayerBoundOut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Module path (native) or layer name (ONNX)")
    kind: str = Field(description="Layer family, e.g. l2_mha, layernorm, linear, block")
    upper: float | None = Field(description="Certified Lipschitz upper bound; null if none")
    status: Verdict = "certified"
    reason: str | None = None
    nodes: list[str] = Field(default_factory=list, description="ONNX nodes making up the layer")
    rule: str | None = Field(default=None, description="The rule that produced `upper` "
                             "(local reports: e.g. LayerNorm on the ball)")
    global_upper: float | None = Field(default=None, description="The layer's global factor "
                                       "when a local rule replaced it")


class BallDomain(BaseModel):
    """A local bound's domain: {X : ||X - X0||_norm <= eps}."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["ball"] = "ball"
    norm: Norm
    eps: float = Field(ge=0, description="Radius of the ball in the bound's norm")
    center_sha256: str = Field(description="sha256 of X0 as float64 little-endian bytes, "
                               "C order, in the model's input shape (1, N, D)")


class GrowthPoint(BaseModel):
    scale: float
    jacobian_norm: float


class Witness(BaseModel):
    """The input that achieved the empirical lower bound, reproducible from the seed."""

    seed: int | None = None
    value: float | None = None
    input_shape: list[int] | None = None
    input: list[float] | None = Field(default=None, description="Flattened witness input")
    growth: list[GrowthPoint] | None = Field(
        default=None, description="(scale, ||J||) pairs growing without bound (DP attention)")
    restarts: int | None = Field(default=None, description="Search restarts (with the seed, "
                                 "they reproduce the witness)")
    steps: int | None = Field(default=None, description="Ascent steps per restart")
    source: str | None = Field(default=None, description="search: found by gradient ascent; "
                               "growth: a Theorem 3.1 input X(s) beat the search")
    scale: float | None = Field(default=None, description="s of the witness when source is "
                                "growth")
    growth_exponent: float | None = Field(
        default=None, description="log-log slope of the last two growth points: ~2 for DP "
        "attention alone, near 0 when the growth levels off (e.g. pre-norm blocks)")


class BoundReport(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model_sha256": "9f2c" + "0" * 60,
                    "norm": "2",
                    "seq_len": 128,
                    "radius": None,
                    "lipschitz": True,
                    "verdict": "certified",
                    "upper": 412.7,
                    "reason": None,
                    "layers": [{"name": "blocks.0.attn", "kind": "l2_mha", "upper": 37.1,
                                "status": "certified", "reason": None, "nodes": []}],
                    "method": "analytic: Theorem 3.2 ...",
                    "lsa_version": "0.1.0",
                    "lower": None,
                    "ratio": None,
                    "witness": None,
                }
            ]
        },
    )

    model_sha256: str
    norm: Norm
    seq_len: int
    radius: float | None = None
    lipschitz: bool | None = Field(
        description="true: certified finite constant; false: not Lipschitz on the domain "
        "(dot-product attention); null: not certified (e.g. untied L2 attention)")
    verdict: Verdict
    upper: float | None = Field(description="Certified upper bound; never below the truth")
    reason: str | None = None
    layers: list[LayerBoundOut]
    method: str
    lsa_version: str
    lower: float | None = Field(default=None, description="Empirical lower bound (max ||J||)")
    ratio: float | None = Field(default=None, description="upper / lower")
    witness: Witness | None = None
    domain: BallDomain | None = Field(default=None, description="Local bounds: the ball "
                                      "around one input; null: the global domain")
