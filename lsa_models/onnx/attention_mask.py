"""Masks around a recognised attention's softmax, read from the graph's constants.

Two spellings the exporters write (docs/bounds.md, "Logits replaced by a constant" and
"The NaN guard of scaled_dot_product_attention"):

- `Where(mask, c, scores)` before the Softmax (`scores.masked_fill(mask, c)`, x-transformers'
  causal mask with c = -finfo.max): the masked logits are *replaced* by constants, not shifted.
  `read_logit_mask` follows the chain of such Wheres and of added constants from the logits
  down to the input-dependent scores and computes, from the constants alone, which entries are
  replaced, by what, and what is added to the others.
- `Where(IsNaN(P), 0, P)` after the Softmax (torch's guard for fully masked rows in
  `F.scaled_dot_product_attention`): the identity when no row of P can be NaN, which
  `guard_is_identity` proves from the same constants (no NaN or +inf among them, every row
  keeps a finite logit) once the scores are known to be the recognised polynomial.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from .attention_probe import NotAttention, data_consumers, token_view
from .graph import GraphInfo
from .ops import Node

_TOL = 1e-7  # relative to how much the scores vary between samples, as attention._fit

# what attention._search finds: (kind, q tensor, k tensor, (c per head, residual, fit error))
Found = tuple[str, tuple[str, bool], tuple[str, bool], tuple[np.ndarray, np.ndarray, float]]


@dataclass
class LogitMask:
    """`logits = where(replaced, fill, scores + additive)`, entrywise, with every array
    input-independent and broadcast to the logits' shape (G, N, N)."""

    scores: str  # the input-dependent tensor the constants act on
    additive: np.ndarray  # (G, N, N) added to the scores where not replaced (-inf: masked)
    replaced: np.ndarray  # (G, N, N) bool: the logit is the constant `fill` there
    fill: np.ndarray  # (G, N, N) the replacing constants (meaningful where `replaced`)
    wheres: list[str]  # the Where nodes that replace logits

    @property
    def replaces(self) -> bool:
        """Some logit is replaced by a finite constant: the plain DP derivation (which lets
        an input-dependent row constant drop out) does not cover it. A logit replaced by
        -inf is a masked key, as an additive -inf."""
        return bool((self.replaced & np.isfinite(self.fill)).any())

    def problem(self) -> str | None:
        """Why a softmax row of these logits could be NaN for finite scores, or None."""
        consts = np.where(self.replaced, self.fill, self.additive)  # (G, N, N)
        if np.isnan(consts).any():
            return "a mask constant is NaN"
        if np.isposinf(consts).any():
            return "a mask constant is +inf"
        if not np.isfinite(consts).any(axis=-1).all():
            return "a row of its mask hides every key"
        return None


def read_logit_mask(info: GraphInfo, logits: str, n: int) -> LogitMask:
    """The constants between the scores and `logits`: Add/Sub of an input-independent tensor
    and Where with an input-independent condition and one input-independent branch, each
    keeping the shape of the input-dependent tensor (no broadcasting of it)."""
    chain: list[tuple[str, object]] = []
    t = logits
    while (prod := info.producer.get(t)) is not None:
        step = _step(info, prod, t)
        if step is None:
            break
        t, op = step
        chain.append((prod.name, op))
    shape = info.shape(logits)
    additive = np.zeros(shape)
    replaced = np.zeros(shape, dtype=bool)
    fill = np.zeros(shape)
    wheres = []
    with np.errstate(invalid="ignore"):  # -inf + inf is NaN: `problem` reports it
        for name, op in reversed(chain):  # forward order: scores first
            if isinstance(op, tuple):  # Where: (condition where the constant is taken, value)
                where, value = op
                replaced = replaced | where
                fill = np.where(where, value, fill)
                wheres.append(name)
            else:  # an added constant shifts both the scores and the replacing constants
                shift = np.asarray(op)
                additive = additive + shift
                fill = fill + shift
    g = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    return LogitMask(t, additive.reshape(g, n, n), replaced.reshape(g, n, n),
                     fill.reshape(g, n, n), wheres)


def _const(info: GraphInfo, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.broadcast_to(info.env[name].detach().numpy().astype(dtype), shape)


def _step(info: GraphInfo, prod: Node, t: str) -> tuple[str, object] | None:
    """(input-dependent input, what the node does with constants) for one chain node."""
    ins = [i for i in prod.inputs if i]
    var_in = [i for i in ins if i in info.var]
    shape = info.shape(t)
    if len(var_in) != 1 or info.shape(var_in[0]) != shape:
        return None
    v = var_in[0]
    if prod.op_type in ("Add", "Sub") and len(ins) == 2:
        if prod.op_type == "Sub" and v != ins[0]:
            return None  # c - scores negates the scores
        other = ins[1] if ins[0] == v else ins[0]
        shift = _const(info, other, shape, np.float64)
        return v, (-shift if prod.op_type == "Sub" else shift)
    if prod.op_type == "Where" and len(prod.inputs) == 3 and prod.inputs[0] not in info.var:
        cond = _const(info, prod.inputs[0], shape, bool)
        if prod.inputs[2] == v:  # Where(cond, c, scores): c where cond
            return v, (cond, _const(info, prod.inputs[1], shape, np.float64))
        if prod.inputs[1] == v:  # Where(cond, scores, c): c where not cond
            return v, (~cond, _const(info, prod.inputs[2], shape, np.float64))
    return None


def nan_guard(info: GraphInfo, p: str) -> str | None:
    """The output of `Where(IsNaN(P), c, P)` when P feeds exactly that guard (IsNaN and the
    Where, nothing else) and c is input-independent, else None."""
    cons = data_consumers(info, p)
    isnan = [c for c in cons if c.op_type == "IsNaN"]
    if len(cons) != 2 or len(isnan) != 1:
        return None
    where = next((c for c in cons if c.op_type == "Where"), None)
    flag = isnan[0].outputs[0]
    if where is None or len(where.inputs) != 3 or where.inputs[0] != flag or \
            where.inputs[2] != p or where.inputs[1] in info.var:
        return None
    if [c.name for c in data_consumers(info, flag)] != [where.name]:
        return None
    return where.outputs[0]


def scores_match(envs: Sequence[Mapping[str, Tensor]], mask: LogitMask,
                 views: tuple[list[np.ndarray], list[np.ndarray]], kind: str,
                 c: np.ndarray, n: int, per_row: bool) -> bool:
    """The scores are `c G` plus an input-independent tensor at every entry and sample, G the
    dot products (or negative squared distances) of the recognised projections; `per_row`
    also allows an input-dependent constant per row (it drops out of a softmax whose logits
    all carry it, i.e. when nothing is replaced). Also: the scores are finite."""
    g_l = mask.additive.shape[0]
    rest = []
    for env, qa, kb in zip(envs, views[0], views[1], strict=True):
        s = env[mask.scores].detach().numpy().reshape(g_l, n, n)
        if not np.isfinite(s).all():
            return False
        prod = qa @ np.swapaxes(kb, 1, 2)  # (G or 1, N, N)
        if kind == "l2":
            prod = -(np.square(qa).sum(-1)[:, :, None] - 2 * prod
                     + np.square(kb).sum(-1)[:, None, :])
        r = s - c[:, None, None] * np.broadcast_to(prod, s.shape)
        rest.append(r - r[..., :1] if per_row else r)
    spread = max(float(np.abs(env[mask.scores].detach().numpy() - envs[0][mask.scores]
                              .detach().numpy()).max()) for env in envs) + 1e-300
    return all(float(np.abs(r - rest[0]).max()) <= _TOL * spread for r in rest[1:])


def check_mask(info: GraphInfo, envs: Sequence[Mapping[str, Tensor]], mask: LogitMask,
               found: Found,
               n: int, guard: str | None) -> None:
    """What certifying a layer with replaced logits or a NaN guard needs beyond the form's
    fit: the constants admit no NaN row, and the scores are exactly the recognised form at
    every entry (without a per-row freedom when logits are replaced)."""
    kind, a, b, (c, _, _) = found
    views = ([token_view(e[a[0]], n, a[1]) for e in envs],
             [token_view(e[b[0]], n, b[1]) for e in envs])
    problem = mask.problem()
    where = (f"Where node {mask.wheres[-1]} replaces logits by constants" if mask.replaces
             else f"Where node {info.producer[guard].name} guards P against NaN" if guard
             else "")
    if problem is not None:
        raise NotAttention(f"{where}, but {problem} (a fully masked row has no softmax); "
                           "keep at least one key unmasked in every row")
    if mask.replaces and kind != "dp":
        raise NotAttention(f"{where}: only dot-product attention with replaced logits is "
                           "covered (docs/bounds.md); mask with float('-inf') instead")
    if not scores_match(envs, mask, views, kind, np.asarray(c), n, not mask.replaces):
        raise NotAttention(f"{where}, and its scores {mask.scores} are not exactly "
                           "c q_i . k_j plus a constant at every entry")
