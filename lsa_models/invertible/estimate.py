"""Training-time spectral-norm estimates for the contractive rescale: never a certified number.

`estimate_norms(mats)` is stateless (the Gram matrix's dominant eigenvector by power steps);
`estimate_norms_warm(mats, starts)` takes the right singular vectors of the previous training
step and does one power step from them, as spectral-norm parametrisations do (Miyato et al.
2018): two matrix-vector products per matrix instead of a Gram matrix and sixteen. Both
return Rayleigh quotients `sigma = ||W^T u||` with unit u, `<=` the true norm, differentiable
in W with gradient `u v^T` (u, v held fixed), the gradient of `||W||_2` at convergence. All
matrices of a call run in a few batched kernels and one autograd node, so a whole
`ContractiveTrunk` (16 matrices at D=64, four layers) costs a small fraction of its layers.
Autocast is off inside (float32 throughout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# Cold start: power steps on each Gram matrix G, the estimate `G^_POWER e_j`, e_j the basis
# vector of G's largest column (Rayleigh quotient error ~ (l2/l1)^(2 _POWER), l the
# eigenvalues of G).
_POWER = 16
_RENORM_EVERY = 3


def _matvec(a: Tensor, v: Tensor) -> Tensor:  # (S, m, k), (S, k) -> (S, m)
    # A broadcast product and a row sum: on CPU several times faster than bmm, whose
    # one-column products go through a general matrix kernel batch by batch.
    return (a * v[:, None, :]).sum(-1)


def _rmatvec(a: Tensor, u: Tensor) -> Tensor:  # (S, m, k), (S, m) -> (S, k)
    return (a * u[:, :, None]).sum(-2)


def _unit(v: Tensor) -> Tensor:  # (S, k) -> (S, k)
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def _dominant_vectors(grams: Tensor) -> Tensor:  # (S, k, k) -> (S, k)
    """Unit estimates of the dominant eigenvector of each PSD matrix: `G^_POWER e_j` with
    j the largest column. G is divided by its trace first (every eigenvalue <= 1, the
    largest >= 1/k) and the vector renormalised every `_RENORM_EVERY` steps, so its entries
    stay far inside float32's range with few normalisations."""
    g = grams / (grams.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None] + 1e-30)
    k = g.shape[-1]
    v = g.gather(-1, g.norm(dim=-2).argmax(-1)[:, None, None].expand(-1, k, 1))[..., 0]
    for i in range(1, _POWER):
        if i % _RENORM_EVERY == 0:
            v = _unit(v)
        v = _matvec(g, v)  # (S, k)
    return _unit(v)


def _tall(w: Tensor) -> Tensor:
    return w.mT if w.shape[-1] > w.shape[-2] else w


def _cold_vectors(stacks: dict[tuple[int, int], Tensor]) -> dict[tuple[int, int], Tensor]:
    """Dominant right singular vectors (S, k) of each stack; Grams of one size share one
    batched chain."""
    by_k: dict[int, list[tuple[int, int]]] = {}
    for mk in stacks:
        by_k.setdefault(mk[1], []).append(mk)
    out: dict[tuple[int, int], Tensor] = {}
    for mks in by_k.values():
        grams = torch.cat([stacks[mk].mT @ stacks[mk] for mk in mks])  # (S, k, k)
        v = _dominant_vectors(grams)  # (S, k)
        out.update(zip(mks, v.split([stacks[mk].shape[0] for mk in mks]), strict=True))
    return out


def _rayleigh(mats: tuple[Tensor, ...], starts: tuple[Tensor, ...] | None
              ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """(sigma, u, v) per matrix without autograd, for the tall orientation W_t of W (`W^T`
    when W is wider than tall): u, v unit, `sigma = u^T W_t v = ||W_t^T u||`; v is the next
    start. Cold (`starts` None): v from `_cold_vectors`, `u = W_t v / ||W_t v||`, then
    `sigma = ||W_t v||`. Warm: `u = W_t v0 / ||.||`, `v = W_t^T u / sigma`."""
    tall = [_tall(w.detach()) for w in mats]
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, w in enumerate(tall):
        shapes.setdefault((w.shape[-2], w.shape[-1]), []).append(i)
    stacks = {mk: torch.cat([tall[i].reshape(-1, *mk) for i in idx])  # (S, m, k)
              for mk, idx in shapes.items()}
    cold = _cold_vectors(stacks) if starts is None else {}
    sigma: list[Tensor] = [torch.empty(0)] * len(mats)
    us, vs = list(sigma), list(sigma)
    for mk, idx in shapes.items():
        w = stacks[mk]  # (S, m, k)
        if starts is not None:
            v0 = torch.cat([starts[i].reshape(-1, mk[1]) for i in idx])  # (S, k)
            u = _matvec(w, v0)  # (S, m)
            n0 = u.norm(dim=-1)  # (S,)
            # A start in a weight's null space (weights replaced since) would give sigma = 0:
            # that group starts cold instead.
            if bool((n0 <= 0).any()):
                cold.update(_cold_vectors({mk: w}))
        if mk in cold:
            v = cold[mk]  # (S, k)
            u = _matvec(w, v)  # (S, m)
            s = u.norm(dim=-1)  # (S,)
            u = u / s.clamp_min(1e-30)[:, None]
        else:
            u = u / n0[:, None]  # (S, m)
            v = _rmatvec(w, u)  # (S, k)
            s = v.norm(dim=-1)  # (S,)
            v = v / s.clamp_min(1e-30)[:, None]
        counts = [math.prod(mats[i].shape[:-2]) for i in idx]
        for i, si, ui, vi in zip(idx, s.split(counts), u.split(counts), v.split(counts),
                                 strict=True):
            lead = mats[i].shape[:-2]
            sigma[i], us[i], vs[i] = si.reshape(lead), ui.reshape(*lead, -1), \
                vi.reshape(*lead, -1)
    return sigma, us, vs


class _RayleighNorms(torch.autograd.Function):
    """One autograd node for a whole call: the forward runs without a graph, the backward is
    the gradient of `u^T W_t v` at fixed u, v (`u v^T`, transposed back for wide W).
    `apply(n, warm, *mats, *starts)`; outputs: the n sigmas, then the u's and v's (not
    differentiable; kept for the backward, the v's also the next starts)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(n: int, warm: bool, *tensors: Tensor) -> tuple[Tensor, ...]:
        sigma, us, vs = _rayleigh(tensors[:n], tensors[n:] if warm else None)
        return (*sigma, *us, *vs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        n = inputs[0]
        ctx.mark_non_differentiable(*output[n:])
        ctx.save_for_backward(*output[n:])
        ctx.wide = [w.shape[-1] > w.shape[-2] for w in inputs[2:2 + n]]
        ctx.n_inputs = len(inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        n = len(ctx.wide)
        out: list[Tensor | None] = [None, None]
        for g, u, v, wide in zip(grads[:n], saved[:n], saved[n:], ctx.wide, strict=True):
            outer = g[..., None, None] * u[..., :, None] * v[..., None, :]  # (..., m, k)
            out.append(outer.mT if wide else outer)
        return (*out, *([None] * (ctx.n_inputs - 2 - n)))


def estimate_norms_warm(mats: list[Tensor], starts: list[Tensor] | None
                        ) -> tuple[list[Tensor], list[Tensor]]:
    """Estimated largest singular value of each matrix in each (..., m, n) stack (shape
    (...) each) and the next start vectors (detached, shape (..., min(m, n))). `starts`:
    the previous call's vectors for matrices of the same shapes (one power step from them),
    or None (a cold start, `estimate_norms`)."""
    if not mats:
        return [], []
    n = len(mats)
    with torch.autocast(mats[0].device.type, enabled=False):
        out = _RayleighNorms.apply(n, starts is not None, *mats, *(starts or []))
    return list(out[:n]), list(out[2 * n:])


def estimate_norms(mats: list[Tensor]) -> list[Tensor]:
    """Stateless estimate (deterministic in the weights): `_POWER` power steps on the Gram
    matrix of each matrix's short side from its largest column, then the Rayleigh quotient."""
    return estimate_norms_warm(mats, None)[0]


@dataclass
class PowerState:
    """A block's warm-start vectors: the right singular vector estimates of its last
    training-mode forward (None before the first). Not model weights (not in the state dict,
    so checkpoints and certificates do not depend on them); a training run saves them with
    its optimizer state (`training.checkpoints`), so a resumed run repeats the uninterrupted
    one bit for bit."""

    vectors: list[Tensor] | None = None

    def starts(self, mats: list[Tensor]) -> list[Tensor] | None:
        """The stored vectors on the matrices' devices when they fit these matrices (same
        count and shapes), else None (a cold start: first step, changed shapes)."""
        vs = self.vectors
        if vs is None or len(vs) != len(mats):
            return None
        want = [(*w.shape[:-2], min(w.shape[-2:])) for w in mats]
        if any(tuple(v.shape) != s for v, s in zip(vs, want, strict=True)):
            return None
        return [v.to(w.device) for v, w in zip(vs, mats, strict=True)]


@dataclass(frozen=True)
class TrainingEstimate:
    """What a training-mode forward of a contractive block needs before it runs: the
    matrices whose spectral norms set its scale, the block's warm-start state, and the
    block's own precomputed operand (the attention's folded output matrix)."""

    mats: list[Tensor]
    power: PowerState
    operand: Tensor | None = None


def run_estimates(estimates: list[TrainingEstimate]) -> list[list[Tensor]]:
    """The norms of every block's matrices in one `estimate_norms_warm` call (warm from each
    block's vectors; cold for all when some block has none that fit), each block's next
    vectors stored in its `PowerState`; returns each block's norms."""
    mats = [m for e in estimates for m in e.mats]
    each = [e.power.starts(e.mats) for e in estimates]
    starts = None if any(s is None for s in each) else [v for s in each if s for v in s]
    norms, vectors = estimate_norms_warm(mats, starts)
    out, i = [], 0
    for e in estimates:
        k = len(e.mats)
        e.power.vectors = vectors[i:i + k]
        out.append(norms[i:i + k])
        i += k
    return out


def power_vectors(model: nn.Module) -> dict[str, Tensor]:
    """Every block's warm-start vectors, keyed `<module name>.<index>` (what a training
    checkpoint saves beside the optimizer state)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        state = getattr(module, "power", None)
        if isinstance(state, PowerState) and state.vectors is not None:
            for i, v in enumerate(state.vectors):
                out[f"{name}.{i}"] = v
    return out


def load_power_vectors(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Restore `power_vectors` into a model of the same structure; blocks with no saved
    vectors keep a cold start."""
    for name, module in model.named_modules():
        state = getattr(module, "power", None)
        if not isinstance(state, PowerState):
            continue
        found: list[Tensor] = []
        while f"{name}.{len(found)}" in tensors:
            found.append(tensors[f"{name}.{len(found)}"].detach().clone())
        state.vectors = found or None
