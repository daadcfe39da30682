"""The driver: runs the layer families over a layer graph, composing constants and collecting
the verdict.

`Context.step(layer, v)` bounds one single-input layer after a value `v`: the layer's own
constant `f` (its family's `local`, from a unit input with `v`'s radius) composed with
`v.lip` by the graph's chain rule; when `v` failed (None) the layer is still bounded, with an
unknown radius, so that its report and its own refusals are listed, and its output fails
too. `run(graph, ...)` walks a whole graph in order, each layer reading and writing named
values. A native model is one root layer (`Context.local(root, x)`: its own constant).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..numerics import mul_up, up
from ..report import NormName
from .families import family_of
from .layers import Chain, Layer, LayerGraph
from .values import Value, Verdicts, failed_value


@dataclass
class Context:
    norm: NormName
    chain: Chain
    acc: Verdicts
    # the domain's input has a radius: a dot-product attention whose input radius is lost on
    # the way is then not certified (it is not proven non-Lipschitz)
    input_bounded: bool

    def compose(self, lip: float, f: float) -> float:
        if self.chain == "fold":
            return up(lip * f)
        return mul_up(lip, f)

    def local(self, layer: Layer, x: Value) -> Value | None:
        """The layer's own constant and output radius from an input of radius `x.radius`."""
        return family_of(layer).local(layer, Value(1.0, x.radius, x.shape), self)

    def step(self, layer: Layer, v: Value | None) -> Value | None:
        x = Value(1.0, None if v is None else v.radius, () if v is None else v.shape)
        f = family_of(layer).local(layer, x, self)
        if failed_value(f) or v is None:
            return None
        assert f is not None
        return Value(self.compose(v.lip, f.lip), f.radius, f.shape)


def run(graph: LayerGraph, ctx: Context, x: Value) -> dict[str, Value | None]:
    """Every value of the graph, the input's being `x`; failed ones are None."""
    values: dict[str, Value | None] = {graph.input: x}
    for layer in graph.layers:
        outs = family_of(layer).bound(layer, [values.get(i) for i in layer.inputs], ctx)
        for name, v in zip(layer.outputs, outs, strict=False):
            values[name] = v
    return values
