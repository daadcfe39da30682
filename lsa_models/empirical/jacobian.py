"""Matrix-free Jacobian norms at one input: `||J_f(X)||_2` and `||J_f(X)||_inf`.

J is never built for the 2-norm: Lanczos (or power iteration) on `J^T J` needs only products
`J v` (forward mode, `torch.func.jvp`) and `J^T w` (reverse mode, `torch.func.vjp`). The
inf-norm needs J's absolute row sums, so rows are built in chunks with a batched (vmapped) vjp.

Every value returned is a Jacobian norm bound from below, realised by a concrete vector: the
2-norm is `||J u||` for the final unit Ritz vector u (so it never exceeds `||J||_2` beyond
rounding, whether or not Lanczos converged), and the inf-norm is an exact row sum. That makes
it a valid lower bound on the Lipschitz constant, never a certified upper bound.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

Fn = Callable[[Tensor], Tensor]
Norm = Literal["2", "inf"]
Method = Literal["lanczos", "power"]

NORMS: tuple[str, ...] = ("2", "inf")


@contextlib.contextmanager
def differentiable_attention() -> Iterator[None]:
    """Run `scaled_dot_product_attention` through its math backend: the fused CPU kernels have
    no forward-mode derivative (and no double backward), which jvp and the ascent both need."""
    with sdpa_kernel([SDPBackend.MATH]):
        yield


@dataclass(frozen=True)
class JacobianConfig:
    """How `jacobian_norm` iterates. `tol` is relative: Lanczos stops once the residual
    `||J^T J u - theta u||` is below `tol * theta`; power iteration once the estimate moves
    less than `tol` relatively. `chunk_size=None` picks a chunk that keeps the vmapped rows'
    attention maps near 2^16 numbers."""

    tol: float = 1e-6
    max_iter: int = 200
    method: Method = "lanczos"
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if not self.tol > 0:
            raise ValueError(f"tol must be > 0, got {self.tol!r}")
        if self.max_iter < 1:
            raise ValueError(f"max_iter must be >= 1, got {self.max_iter!r}")
        if self.method not in ("lanczos", "power"):
            raise ValueError(f"method must be 'lanczos' or 'power', got {self.method!r}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size!r}")


@dataclass(frozen=True)
class JacobianNorm:
    """`value` is `||J u||_2` for the unit vector `vector` (2-norm) or the largest absolute row
    sum among the rows evaluated (inf-norm; row `row`, flat index into f's output)."""

    value: float
    norm: Norm
    method: str
    iterations: int  # products with J^T J (2-norm) or vmapped row chunks (inf-norm)
    converged: bool
    rel_residual: float  # 2-norm: ||J^T J u - theta u|| / theta at the last step; inf: 0
    vector: Tensor | None = None  # unit right singular vector estimate, X's shape (2-norm)
    row: int | None = None  # argmax row (inf-norm)
    rows_evaluated: int = 0  # inf-norm: how many rows of J were built


def check_norm(norm: str) -> Norm:
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    return norm  # type: ignore[return-value]


def jacobian_norm(f: Fn, x: Tensor, norm: str, *, tol: float = 1e-6, max_iter: int = 200,
                  method: Method = "lanczos", chunk_size: int | None = None,
                  rows: Tensor | None = None, v0: Tensor | None = None,
                  seed: int = 0) -> JacobianNorm:
    """`||J_f(x)||_norm` without materialising J (2-norm) or in row chunks (inf-norm).

    `f` maps a tensor of x's shape to a tensor (any shape). `rows` (inf-norm only): flat output
    indices to evaluate; None evaluates all, which is exact. `v0` warm-starts the 2-norm
    iteration; otherwise the start vector is drawn from `seed` (reproducible).
    """
    cfg = JacobianConfig(tol=tol, max_iter=max_iter, method=method, chunk_size=chunk_size)
    norm = check_norm(norm)
    x = x.detach()
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    with torch.no_grad():  # no graph towards the weights; torch.func still differentiates x
        if norm == "2":
            return _two_norm(f, x, cfg, v0, seed)
        return inf_norm_rows(f, x, rows, cfg.chunk_size)


# ---------------------------------------------------------------------------------- 2-norm


class _Products:
    """`J v` and `J^T w` at a fixed x; the forward pass for vjp runs once."""

    def __init__(self, f: Fn, x: Tensor) -> None:
        self.f, self.x = f, x
        with differentiable_attention():
            pulled = torch.func.vjp(f, x)  # (f(x), vjp_fn)
        y, self._vjp = pulled[0], pulled[1]
        self.out_shape = y.shape

    def jv(self, v: Tensor) -> Tensor:
        with differentiable_attention():
            return torch.func.jvp(self.f, (self.x,), (v,))[1]

    def jtw(self, w: Tensor) -> Tensor:
        with differentiable_attention():
            return self._vjp(w)[0]

    def gram(self, v: Tensor) -> Tensor:
        return self.jtw(self.jv(v))  # J^T J v


def _start_vector(x: Tensor, v0: Tensor | None, seed: int) -> Tensor:
    if v0 is not None:
        if v0.shape != x.shape:
            raise ValueError(f"v0 has shape {tuple(v0.shape)}, expected {tuple(x.shape)}")
        v = v0.detach().to(x.dtype)
    else:
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)
    nv = v.norm()
    if not torch.isfinite(nv) or nv == 0:
        raise ValueError("start vector is zero or not finite")
    return v / nv


def _two_norm(f: Fn, x: Tensor, cfg: JacobianConfig, v0: Tensor | None,
              seed: int) -> JacobianNorm:
    ops = _Products(f, x)
    v = _start_vector(x, v0, seed)
    if cfg.method == "power":
        u, its, conv, res = _power(ops, v, cfg)
    else:
        u, its, conv, res = _lanczos(ops, v, cfg)
    value = float(ops.jv(u).norm())  # realised by u: never above ||J||_2 beyond rounding
    return JacobianNorm(value, "2", cfg.method, its, conv, res, vector=u)


def _power(ops: _Products, v: Tensor, cfg: JacobianConfig) -> tuple[Tensor, int, bool, float]:
    est = 0.0
    for it in range(1, cfg.max_iter + 1):
        w = ops.gram(v)  # (x's shape)
        lam = float(torch.dot(v.reshape(-1), w.reshape(-1)))  # Rayleigh quotient
        nw = w.norm()
        if nw == 0:
            return v, it, True, 0.0  # J v = 0 for the current direction and J^T J v = 0
        res = float((w - lam * v).norm()) / max(lam, 1e-300)
        v = w / nw
        if it > 1 and abs(lam - est) <= cfg.tol * max(abs(lam), 1e-300):
            return v, it, True, res
        est = lam
    return v, cfg.max_iter, False, res


def _lanczos(ops: _Products, v: Tensor, cfg: JacobianConfig) -> tuple[Tensor, int, bool, float]:
    """Lanczos on the symmetric PSD `J^T J` with full reorthogonalisation (the basis is kept
    anyway to form the Ritz vector, and it keeps float32 runs from spawning ghost values)."""
    n = v.numel()
    basis: list[Tensor] = [v.reshape(-1)]
    alphas: list[float] = []
    betas: list[float] = []
    s_top = torch.ones(1, dtype=torch.float64)
    res = math.inf
    conv = False
    its = 0
    for k in range(min(cfg.max_iter, n)):
        its = k + 1
        q = basis[-1]
        w = ops.gram(q.view_as(v)).reshape(-1)  # (n,)
        alpha = float(torch.dot(q, w))
        alphas.append(alpha)
        q_mat = torch.stack(basis)  # (k+1, n)
        for _ in range(2):  # twice is enough (Kahan): keeps the basis orthogonal to rounding
            w = w - q_mat.T @ (q_mat @ w)
        beta = float(w.norm())
        t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if betas:
            off = torch.tensor(betas, dtype=torch.float64)
            t = t + torch.diag(off, 1) + torch.diag(off, -1)
        evals, evecs = torch.linalg.eigh(t)
        theta = float(evals[-1])
        s_top = evecs[:, -1]
        res = beta * abs(float(s_top[-1])) / max(theta, 1e-300)
        if theta <= 0 or res <= cfg.tol or beta <= 1e-12 * max(theta, 1e-300):
            conv = True
            break
        if k + 1 == n:
            conv = True  # the Krylov space is the whole space: T is J^T J in this basis
        elif k + 1 < cfg.max_iter:
            betas.append(beta)
            basis.append(w / beta)
    q_mat = torch.stack(basis[: s_top.numel()])  # (k, n)
    u = (s_top.to(q_mat.dtype) @ q_mat).reshape(v.shape)
    nu = u.norm()
    u = u / nu if nu > 0 else v
    return u, its, conv, float(res)


# ------------------------------------------------------------------------------- inf-norm


def auto_chunk(x: Tensor, out_numel: int) -> int:
    """Rows per vmapped vjp. Batching pays off while per-call overhead dominates; once the
    intermediates (attention maps, about N^2 numbers per head) are large, a batch only adds
    memory traffic (measured: 16 rows at N=1000 cost 2x per row what single rows do), so keep
    chunk * (N^2 + numel) near 2^16."""
    tokens = x.shape[0] if x.dim() >= 2 else 1
    per_row = tokens * tokens + x.numel() + out_numel
    return int(max(1, min(64, 2**16 // max(per_row, 1))))


def inf_norm_rows(f: Fn, x: Tensor, rows: Tensor | None = None,
                  chunk_size: int | None = None) -> JacobianNorm:
    """Largest absolute row sum of J over `rows` (flat output indices; None: all rows)."""
    x = x.detach()
    with torch.no_grad(), differentiable_attention():
        pulled = torch.func.vjp(f, x)  # (f(x), vjp_fn)
    y, vjp_fn = pulled[0], pulled[1]
    m = y.numel()
    idx = torch.arange(m) if rows is None else rows.reshape(-1).to(torch.long)
    if idx.numel() == 0:
        raise ValueError("rows is empty")
    if int(idx.min()) < 0 or int(idx.max()) >= m:
        raise ValueError(f"rows must lie in [0, {m}); f's output has {m} entries")
    chunk = chunk_size or auto_chunk(x, m)
    batched = torch.func.vmap(vjp_fn)
    best, best_row, chunks = -1.0, -1, 0
    for start in range(0, idx.numel(), chunk):
        sel = idx[start:start + chunk]  # (c,)
        cot = torch.zeros((sel.numel(), m), dtype=y.dtype)  # (c, numel out)
        cot[torch.arange(sel.numel()), sel] = 1.0
        with torch.no_grad(), differentiable_attention():
            (grads,) = batched(cot.view(sel.numel(), *y.shape))  # (c, *x.shape)
        sums = grads.reshape(sel.numel(), -1).abs().sum(dim=1)  # (c,)
        chunks += 1
        val, pos = sums.max(dim=0)
        if float(val) > best:
            best, best_row = float(val), int(sel[int(pos)])
    return JacobianNorm(best, "inf", "row-sums", chunks, True, 0.0, row=best_row,
                        rows_evaluated=int(idx.numel()))


__all__ = [
    "NORMS",
    "Fn",
    "JacobianConfig",
    "JacobianNorm",
    "Norm",
    "auto_chunk",
    "check_norm",
    "differentiable_attention",
    "inf_norm_rows",
    "jacobian_norm",
]
