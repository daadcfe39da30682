"""The typed layer graph both front ends lower to: a `LayerGraph` is a list of layers in
evaluation order, each reading the values named by `inputs` and writing those named by
`outputs` (ONNX tensor names; a native model is one root layer on "x"). The kinds and what
each carries: docs/engine.md, "Layer kinds"; float64 readings happen in the families, so a
front end hands over the tensors it has. `families.py` bounds each kind, `driver.py` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..report import Verdict

ArrayLike = Any  # a torch tensor or a numpy array: the formulas read either in float64


@dataclass
class Layer:
    name: str
    inputs: list[str] = field(default_factory=list, kw_only=True)
    outputs: list[str] = field(default_factory=list, kw_only=True)
    nodes: list[str] = field(default_factory=list, kw_only=True)  # ONNX nodes it stands for
    shape: tuple[int, ...] = field(default=(), kw_only=True)  # output shape (graphs only)


@dataclass
class Linear(Layer):
    weight: ArrayLike  # torch layout (out, in)
    bias: ArrayLike | None = None


@dataclass
class Norm(Layer):
    gamma: ArrayLike
    beta: ArrayLike | None
    eps: float
    rms: bool = False


@dataclass
class Activation(Layer):
    act: str  # a key of numerics.LAYER_ACTIVATION_LIPSCHITZ


@dataclass
class Identity(Layer):
    pass


@dataclass
class DPAttention(Layer):
    wq: ArrayLike  # (H, D, d)
    wk: ArrayLike
    wv: ArrayLike  # (H, D, dv)
    wo: ArrayLike  # (H dv, D_out)
    n: int  # tokens the attention sees
    scale: float | None = None  # None: the canonical 1/sqrt(d), rounded as the formula does
    bq: ArrayLike | None = None
    bv: ArrayLike | None = None
    bo: ArrayLike | None = None
    notes: list[str] = field(default_factory=list)
    # logits replaced by constants on a fixed set of entries (masked_fill), or a rotary key
    # bias: the bound without row centring, which uses the key bias (docs/bounds.md, "Logits
    # replaced by a constant", "Rotary position embeddings")
    bk: ArrayLike | None = None
    replaced: bool = False


@dataclass
class L2Attention(Layer):
    wq: ArrayLike  # (H, D, d), tied query/key
    wv: ArrayLike
    wo: ArrayLike
    n: int
    causal: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class Refused(Layer):
    kind: str  # the report's kind ("l2_mha_untied", "attention", ...)
    status: Verdict
    reason: str


@dataclass
class Series(Layer):
    body: list[Layer]
    block: bool = False  # report the composed factor as a "block" entry


@dataclass
class Residual(Layer):
    branch: Layer


@dataclass
class CertifiedResidual(Layer):
    kind: str  # the report's kind ("contractive_l2_block", ...)
    # the block (an nn.Module, kept untyped: the engine imports no model code) whose
    # `lipschitz_upper(n)` is a certified bound on Lip_2 of its branch on n tokens
    block: Any
    n: int  # tokens the block sees


@dataclass
class OpNode(Layer):
    node: Any  # onnx.ops.Node
    consts: dict[str, Any]  # input name -> float64 (or integer) numpy array
    variables: frozenset[str]  # the node inputs that depend on the model input
    out_shapes: list[tuple[int, ...]] = field(default_factory=list)
    report: str | None = None  # the kind its entry is reported under; None: no entry


Chain = Literal["fold", "mul_up"]


@dataclass
class LayerGraph:
    """Layers in evaluation order; `chain` is how a layer's own constant `f` composes with
    the constant `L` of its input: "fold" `up(L f)` (so a series of factors from 1.0 is
    exactly `mul_up(f_1, ..., f_k)`, the native driver's product) or "mul_up"
    `mul_up(L, f) = up(up(L) f)` (the ONNX driver's); both round upward."""

    layers: list[Layer]
    input: str
    output: str
    chain: Chain
