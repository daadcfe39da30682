"""The margins' lower bounds from the affine forms alone (affine/form.py: no Jacobian enclosure):
one affine walk over the graph at the centre's forward pass, the margins f_label - f_j of the
output's form, and those of a final LayerNorm deferred past the head (heads/final_layernorm.py) or
of a ReLU head relaxed per margin (heads/relu_head.py), the larger of each pair standing.
"""

from __future__ import annotations

import numpy as np
import torch

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine.walk import walk
from lsa_models.engine.drivers.centre import Centre, check_center, check_eps
from lsa_models.engine.drivers.jacobian_walk import fused_chains
from lsa_models.engine.heads import final_layernorm, relu_head
from lsa_models.engine.values import Ball
from lsa_models.onnx.loading import OnnxModel
from lsa_models.onnx.ops import Node

# the margins past a final LayerNorm with its product deferred past the head
# (heads/final_layernorm.py)
DEFER = True

# the affine route's products record their cross terms' l1 budgets (affine.GROUPS: a
# perturbation cannot put every entry's cross term at its extreme at once; larger radii)
SYMBOL_GROUPS = True


def margin_lower_bounds(model: OnnxModel, x0: np.ndarray, eps: float, norm: str, label: int,
                        centre: Centre | None = None, quad: bool = False, eig: bool = False
                        ) -> dict[int, float] | None:
    """Lower bounds of the margins f_label - f_j over the ball, from the affine forms alone
    (affine/form.py: no Jacobian enclosure); None when the forms do not reach the output. `eig`:
    with `quad` on the 2-ball, the second-order parts of the entries' sizes by their
    quadratic forms' eigenvalues (affine.QUAD_EIG: tighter, ~4x the time)."""
    check_eps(eps)
    x = check_center(model, x0)
    ctr = centre if centre is not None else Centre(model, x)
    # the products' cross terms as l1 groups of symbols (affine.GROUPS) for this walk and its
    # margins
    token_g = affine.GROUPS.set([] if SYMBOL_GROUPS else None)
    token_e = affine.QUAD_EIG.set(eig and quad)
    try:
        return _margin_lower_bounds(model, x, eps, norm, label, ctr, quad)
    finally:
        affine.QUAD_EIG.reset(token_e)
        affine.GROUPS.reset(token_g)


def _margin_lower_bounds(model: OnnxModel, x: np.ndarray, eps: float, norm: str, label: int,
                         ctr: Centre, quad: bool) -> dict[int, float] | None:
    with ctr:
        ball = Ball(x, float(eps), norm)
        chains, inside = fused_chains(model, ctr.module, ctr.env)
        nodes: list[Node] = list(ctr.module.runtime_nodes)  # type: ignore[arg-type]
        tail = final_layernorm.find_tail(nodes, model.spec.output_name, ctr.env, rms=True,
                                  input_name=model.spec.input_name) if DEFER else None
        capture: dict[str, affine.Aff | None] = {} if tail is None else {
            tail[0].inputs[0]: None}
        relu = None
        if tail is None and DEFER:
            # a ReLU head instead: its input's and output's forms (heads/relu_head.py)
            relu = relu_head.find_relu_tail(nodes, model.spec.output_name, ctr.env,
                                            model.spec.input_name)
            if relu is not None:
                capture = {relu[0].inputs[0]: None, relu[0].outputs[0]: None}
                capture.update({name: None for name, _ in relu[2]})
        space: list[int] = []
        forms = walk(nodes, model.spec.input_name, ctr.env, ball, chains, inside,
                                  model.spec.output_name, everything=False, capture=capture,
                                  space=space, quad=quad)
        out = forms.get(model.spec.output_name)
        if out is None:
            return None
        # the margins' ranges and the deferred head's products read the walk's second-order
        # symbols, when it had them; the head's errors get symbols after the walk's
        token_q = affine.QUAD.set(ball.size if quad else None)
        token_s = affine.SPACE.set(list(space) if space else None)
        try:
            if relu is not None:
                return _relu_margins(ctr.env, ball, out, label, relu, capture)
            return _margins_of_forms(nodes, model.spec.output_name, ctr.env, ball, out,
                                     label, tail, capture)
        finally:
            affine.SPACE.reset(token_s)
            affine.QUAD.reset(token_q)


def _relu_margins(env: dict[str, torch.Tensor], ball: Ball, out: affine.Aff, label: int,
                  relu: relu_head.Tail, capture: dict[str, affine.Aff | None]
                  ) -> dict[int, float]:
    """The plain margins and those with the head's ReLU relaxed per margin (heads/relu_head.py):
    both lower bounds of the same margins, the larger stands."""
    res = affine.margins(out, label, ball)
    z, y = capture.get(relu[0].inputs[0]), capture.get(relu[0].outputs[0])
    sides = [(name, pos, capture.get(name)) for name, pos in relu[2]]
    if z is None or y is None or any(f is None for _, _, f in sides):
        return res
    try:
        low = relu_head.margins(relu[1], env, ball, relu[0], z, y, out, label,
                                sides)  # type: ignore[arg-type]
    except (affine.NotAffine, FloatingPointError, ValueError, RuntimeError, KeyError,
            IndexError, TypeError):
        return res  # an optional refinement: the plain margins stand
    return {j: max(v, low.get(j, v)) for j, v in res.items()}


def _margins_of_forms(nodes: list[Node], output: str, env: dict[str, torch.Tensor],
                      ball: Ball, out: affine.Aff, label: int,
                      tail: tuple[Node, list[Node]] | None,
                      capture: dict[str, affine.Aff | None]) -> dict[int, float]:
    """The margins' lower bounds from the output's form, and from the final LayerNorm's
    product deferred past the head (heads/final_layernorm.py) where its input's form was captured:
    both are lower bounds of the same margins, the larger stands."""
    res = affine.margins(out, label, ball)
    if tail is None or not all(v is not None for v in capture.values()):
        return res
    try:
        low = final_layernorm.margins(nodes, output, env, ball,
                               {k: v for k, v in capture.items() if v is not None},
                               out, label, tail)
    except (affine.NotAffine, FloatingPointError, ValueError, RuntimeError, KeyError,
            IndexError, TypeError):
        return res  # an optional refinement: the plain margins stand
    return res if low is None else {j: max(v, low[j]) for j, v in res.items()}

