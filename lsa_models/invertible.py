"""Certified invertible residual blocks: contractive L2 attention and contractive FFN.

docs/theory.md, "Invertible (contractive) self-attention": `G(X) = X + g(X)` is invertible when
`Lip_2(g) <= c < 1`. Every block here scales its branch by a factor computed from a certified
float64 upper bound of the branch's Lipschitz constant for the *current* weights, so the
certificate holds after every optimiser step:

- `ContractiveL2Block`: `g(X) = c F(X) / U(F)`, F a tied L2-MHA (causal or not), U the
  Theorem 3.2 2-norm bound from `bounds.formulas.l2_mha_bound` at the block's `max_len`
  (the bound grows with N, so it covers every shorter sequence too).
- `ContractiveFFNBlock`: `g(x) = c (W2/s2) act((W1/s1) x + b1) / L_act + b2` per token, with
  s1, s2 certified spectral norms and L_act the activation's Lipschitz constant.

Training needs a gradient through U. The forward pass uses the certified float64 value
(rounded so the float32 scale factor is never above `c / U_cert`); a torch surrogate of the
same formula only supplies the gradient (`surrogate - surrogate.detach()` is exactly 0).

The inverse is Banach's fixed point `X_{k+1} = Y - g(X_k)` with the a-posteriori bound
`||X_k - X*|| <= c/(1-c) ||X_k - X_{k-1}||` (Frobenius norm per sequence). A residual block
with no certified constant (dot-product attention, Theorem 3.1) gets no bound, and its
iteration is reported as failed, never returned as if it were an inverse.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import Tensor, nn

from .attention import L2MHA, DotProductMHA
from .bounds.formulas import _two_norm_lead, l2_mha_bound
from .bounds.numerics import ACTIVATION_LIPSCHITZ, add_up, div_up, mul_up, spectral_norm_upper
from .bounds.report import Domain, LayerBound, NormName
from .bounds.rules import Bound, compose, register_rule
from .config import AttentionConfig, ConfigError

if TYPE_CHECKING:
    from .bounds.analyzer import Analyzer

# The float32 scale is taken this much below c / U so that rounding c/U to float32 and then
# re-multiplying in upward-rounded float64 still certifies `<= c`.
_SCALE_MARGIN = 1.0 - 2.0**-20

InverseStatus = Literal["atol", "rtol", "max_iter", "diverged"]


class NotInvertibleError(RuntimeError):
    """A fixed-point inverse did not converge to a certified tolerance."""


class NonFiniteWeightsError(ValueError):
    """A contractive block's weights hold NaN or infinity (e.g. after a diverged step): no
    bound, hence no scale, exists."""


def _require_finite(params: list[Tensor], what: str) -> None:
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise NonFiniteWeightsError(f"{what}: weights contain NaN or infinity; no certified "
                                    "bound exists (the training run has diverged)")


def _check_c(c: float) -> None:
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0.0 < float(c) < 1.0:
        raise ConfigError("c", f"must satisfy 0 < c < 1 for a contractive branch, got {c!r}")


def _float32_down(x: float) -> float:
    """The largest float32 value <= x (x > 0)."""
    y = float(np.float32(x))
    if y > x:
        y = float(np.nextafter(np.float32(y), np.float32(0.0)))
    return y


def _outside_transforms() -> AbstractContextManager[object]:
    """Step out of torch.func transforms (jacrev, vjp): inside them even a parameter cannot be
    read into numpy, and the certified bound is a function of the weights alone."""
    try:
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    except ImportError:  # pragma: no cover - private API moved; plain eager mode still works
        return nullcontext()
    return temporarily_clear_interpreter_stack()  # type: ignore[no-any-return]


def _param_key(params: list[Tensor]) -> tuple[object, ...]:
    # `_version` moves on every in-place update (optimizer.step, load_state_dict), data_ptr
    # and dtype on .to()/.double(): together they say when the cached bound is stale.
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)


@functools.lru_cache(maxsize=256)
def _lead(n: int, causal: bool) -> float:
    """The N-dependent factor of the Theorem 3.2 2-norm bound (causal: root sum of squares of
    the prefix factors), as in `bounds.formulas.l2_mha_bound`; cached, it costs ~N Lambert Ws."""
    if causal:
        return math.sqrt(sum(_two_norm_lead(max(i, 2)) ** 2 for i in range(1, n + 1)))
    return _two_norm_lead(max(n, 2))


def _spec_norms(w: Tensor) -> Tensor:
    """Largest singular value of each matrix in a (..., m, n) stack, differentiable."""
    return torch.linalg.matrix_norm(w.float(), ord=2)


@dataclass(frozen=True)
class ContractiveL2Config:
    d_model: int
    n_heads: int
    max_len: int
    c: float = 0.9
    causal: bool = True

    def __post_init__(self) -> None:
        AttentionConfig(self.d_model, self.n_heads, "l2", True, self.causal)  # validates
        if not isinstance(self.max_len, int) or isinstance(self.max_len, bool) \
                or self.max_len < 1:
            raise ConfigError("max_len", f"must be a positive integer, got {self.max_len!r}")
        _check_c(self.c)


@dataclass(frozen=True)
class ContractiveFFNConfig:
    d_model: int
    d_ff: int
    c: float = 0.9
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = "relu"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if self.activation not in ACTIVATION_LIPSCHITZ:
            raise ConfigError("activation", f"unknown activation {self.activation!r}; use one "
                              f"of {', '.join(ACTIVATION_LIPSCHITZ)}")
        _check_c(self.c)


class ResidualBlock(nn.Module):
    """`G(X) = X + g(X)` with `branch = g`; `lipschitz_upper()` is Lip_2(g) or None."""

    def branch(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def lipschitz_upper(self, seq_len: int | None = None) -> float | None:
        """Certified upper bound on Lip_2 of the branch on sequences of `seq_len` tokens."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        return x + self.branch(x)

    def inverse(self, y: Tensor, atol: float = 1e-6, rtol: float = 0.0,
                max_iter: int = 1000) -> InverseResult:
        with torch.no_grad():
            return fixed_point_inverse(self.branch, y, self.lipschitz_upper(y.shape[1]),
                                       atol=atol, rtol=rtol, max_iter=max_iter)


class ContractiveL2Block(ResidualBlock):
    """`X + c F(X) / U(F)` with F a tied L2-MHA and U its certified Theorem 3.2 2-norm bound."""

    def __init__(self, config: ContractiveL2Config) -> None:
        super().__init__()
        self.config = config
        self.attn = L2MHA(config.d_model, config.n_heads, causal=config.causal)
        self._cache_key: tuple[object, ...] | None = None
        self._cache: tuple[float, float] = (0.0, 0.0)  # (U_cert, scale32)
        self.frozen: float | None = None

    def _weights(self) -> list[Tensor]:
        return [self.attn.q_proj.weight, self.attn.v_proj.weight, self.attn.out_proj.weight]

    def certified_u(self, seq_len: int | None = None) -> float:
        """Theorem 3.2 (2-norm, causal extension when causal) for the current weights."""
        a = self.attn
        n = self.config.max_len if seq_len is None else seq_len
        return l2_mha_bound(a.query_weights(), a.value_weights(), a.output_weight(), n, "2",
                            self.config.causal)

    def _certified(self) -> tuple[float, float]:
        with _outside_transforms():
            key = _param_key(self._weights())
            if key != self._cache_key:
                _require_finite(self._weights(), "contractive L2 attention")
                with torch.no_grad():
                    u = self.certified_u()
                scale = _float32_down(self.config.c / u * _SCALE_MARGIN) if u > 0 else 0.0
                self._cache, self._cache_key = (u, scale), key
        return self._cache

    def _surrogate_u(self) -> Tensor:
        """The certified bound's formula in torch (differentiable; for gradients only): the
        smallest of `bounds.formulas.l2_mha_candidates` in the 2-norm, exact float32 SVDs."""
        a = self.attn
        h, d = self.config.n_heads, self.config.d_model // self.config.n_heads
        lead = _lead(self.config.max_len, self.config.causal)
        with torch.autocast(a.q_proj.weight.device.type, enabled=False):
            wq, wv = a.query_weights().float(), a.value_weights().float()  # (H, D, d)
            wo = a.output_weight().float()  # (D, D)
            m = torch.einsum("hke,hkf->hef", wq, wv) / math.sqrt(d)  # (H, d, d)
            b = torch.bmm(m, wo.reshape(h, d, -1))  # (H, d, D)
            sq, sv, so = _spec_norms(wq), _spec_norms(wv), _spec_norms(wo)  # (H,), (H,), ()
            sm, sb = _spec_norms(m), _spec_norms(b)  # (H,), (H,)
            # ||W^Q||^4: the corrected weight term of bounds.formulas._two_norm_weights
            # (test_forward_uses_certified_scale_and_surrogate_gradient keeps them in step).
            theorem = torch.sqrt((sq**4 * sv * sv).sum()) * so / math.sqrt(d)
            per_head = so * torch.sqrt(((sq * sm) ** 2).sum())
            head_sum = (sq * sb).sum()
            concat = _spec_norms(a.q_proj.weight) * _spec_norms(b.reshape(h * d, -1))
            return lead * torch.stack([theorem, per_head, head_sum, concat]).min()

    def scale(self) -> Tensor | float:
        """The factor multiplying F(X): value `<= c / U_cert`, gradient of `c / U_torch`."""
        if self.frozen is not None:
            return self.frozen
        _, s = self._certified()
        w = self.attn.q_proj.weight
        if torch.is_grad_enabled() and w.requires_grad:
            sur = self.config.c / self._surrogate_u()
            return (sur - sur.detach()) + s  # forward value exactly s
        return s

    def lipschitz_upper(self, seq_len: int | None = None) -> float:
        n = self.config.max_len if seq_len is None else seq_len
        u_n = self._certified()[0] if n <= self.config.max_len else self.certified_u(n)
        # Lip(g) = scale * Lip(F) <= scale * U(n); U(n) <= U(max_len) for n <= max_len.
        return mul_up(self._certified()[1], u_n)

    def branch(self, x: Tensor) -> Tensor:  # (B, N, D)
        if x.shape[1] > self.config.max_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds the certified max_len="
                             f"{self.config.max_len}")
        return self.attn(x) * self.scale()  # (B, N, D)


class ContractiveFFNBlock(ResidualBlock):
    """Token-wise `x + c (W2/s2) act((W1/s1) x + b1) / L_act + b2`, s_i certified norms."""

    def __init__(self, config: ContractiveFFNConfig) -> None:
        super().__init__()
        self.config = config
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh,
                    "sigmoid": nn.Sigmoid}[config.activation]()
        nn.init.normal_(self.fc1.weight, std=config.d_model ** -0.5)
        nn.init.normal_(self.fc2.weight, std=config.d_ff ** -0.5)
        nn.init.zeros_(self.fc1.bias)
        nn.init.zeros_(self.fc2.bias)
        self._cache_key: tuple[object, ...] | None = None
        self._cache: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        self.frozen: tuple[float, float] | None = None

    def _certified(self) -> tuple[float, float, float, float]:
        """(s1, s2, a, b): certified spectral norms and the float32 scales a <= 1/s1,
        b <= c / (L_act s2)."""
        with _outside_transforms():
            key = _param_key([self.fc1.weight, self.fc2.weight])
            if key != self._cache_key:
                _require_finite([self.fc1.weight, self.fc2.weight], "contractive FFN")
                with torch.no_grad():
                    s1 = spectral_norm_upper(self.fc1.weight)
                    s2 = spectral_norm_upper(self.fc2.weight)
                lact = ACTIVATION_LIPSCHITZ[self.config.activation]
                a = _float32_down(_SCALE_MARGIN / s1) if s1 > 0 else 1.0
                b = _float32_down(self.config.c * _SCALE_MARGIN / (lact * s2)) if s2 > 0 else 0.0
                self._cache, self._cache_key = (s1, s2, a, b), key
        return self._cache

    def scales(self) -> tuple[Tensor | float, Tensor | float]:
        if self.frozen is not None:
            return self.frozen
        _, _, a, b = self._certified()
        w = self.fc1.weight
        if torch.is_grad_enabled() and w.requires_grad:
            lact = ACTIVATION_LIPSCHITZ[self.config.activation]
            with torch.autocast(w.device.type, enabled=False):
                sa = 1.0 / _spec_norms(self.fc1.weight)
                sb = self.config.c / (lact * _spec_norms(self.fc2.weight))
            return (sa - sa.detach()) + a, (sb - sb.detach()) + b
        return a, b

    def lipschitz_upper(self, seq_len: int | None = None) -> float:
        s1, s2, a, b = self._certified()
        lact = ACTIVATION_LIPSCHITZ[self.config.activation]
        return mul_up(a, s1, lact, b, s2)  # token-wise: same constant on sequences

    def branch(self, x: Tensor) -> Tensor:  # (B, N, D)
        # Scale the products, not the weights: the certified map is then exactly
        # `a W1 x` with the stored W1 (a rounded weight copy fl(a W1) would not be).
        a, b = self.scales()
        h = self.act(nn.functional.linear(x, self.fc1.weight) * a + self.fc1.bias)  # (B, N, F)
        return nn.functional.linear(h, self.fc2.weight) * b + self.fc2.bias  # (B, N, D)


class DPResidualBlock(ResidualBlock):
    """`X + F(X)` with dot-product attention: not Lipschitz (Theorem 3.1), so no certificate
    and no guaranteed inverse. Here to show what the fixed-point inverse does without one."""

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        self.config = config
        self.attn = DotProductMHA.from_config(config)

    def lipschitz_upper(self, seq_len: int | None = None) -> None:
        return None

    def branch(self, x: Tensor) -> Tensor:
        return self.attn(x)


@dataclass
class InverseResult:
    """Outcome of a fixed-point inverse.

    `x` is the last iterate; it is an inverse only when `converged` (the tolerance was met).
    `error_bound` bounds `max over sequences ||x - X*||_F` (Banach a-posteriori); it is inf
    when the branch has no certified constant < 1, and then `converged` is always False.
    `predicted_iterations` is Banach's a-priori count for atol (None without atol or bound).
    """

    x: Tensor
    iterations: int
    error_bound: float
    converged: bool
    status: InverseStatus
    lipschitz: float | None
    predicted_iterations: int | None = None
    residual: float = math.nan
    message: str = ""

    def unwrap(self) -> Tensor:
        """The inverse, or NotInvertibleError saying why there is none."""
        if not self.converged:
            raise NotInvertibleError(self.message)
        return self.x


def banach_iterations(lip: float, first_step: float, tol: float) -> int:
    """Smallest k with `lip^k / (1 - lip) * first_step <= tol`: the a-posteriori bound at
    iteration k is at most this, so the iteration stops no later than k."""
    if first_step <= 0:
        return 1
    if tol <= 0:
        return 2**62
    if lip == 0:
        return 1
    k = math.log(tol * (1.0 - lip) / first_step) / math.log(lip)
    return max(1, math.ceil(k - 1e-9))


def _per_seq_norm(t: Tensor) -> Tensor:
    return t.flatten(1).norm(dim=1)  # (B,)


def fixed_point_inverse(g: Callable[[Tensor], Tensor], y: Tensor, lipschitz: float | None,
                        atol: float = 1e-6, rtol: float = 0.0,
                        max_iter: int = 1000) -> InverseResult:
    """Solve `x + g(x) = y` by `x_{k+1} = y - g(x_k)`, from `x_0 = y`.

    Stops when, for every sequence, the bound `c/(1-c) ||x_k - x_{k-1}||_F` is <= atol
    (status "atol") or <= rtol ||x_k||_F ("rtol"); or after max_iter iterations ("max_iter");
    or when the steps blow up or turn non-finite ("diverged"). With no certified `c < 1` there
    is no bound: the steps are still tracked (so divergence is seen) but the result is never
    marked converged.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    if atol == 0 and rtol == 0:
        raise ValueError("give atol > 0 or rtol > 0: with both 0 the iteration cannot stop")
    if not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
    certified = lipschitz is not None and lipschitz < 1.0
    factor = lipschitz / (1.0 - lipschitz) if certified else math.inf  # type: ignore[operator]
    x = y
    first: float | None = None
    predicted: int | None = None
    bound = math.inf
    status: InverseStatus = "max_iter"
    it = 0
    for k in range(1, max_iter + 1):
        it = k
        x_new = y - g(x)  # (B, N, D)
        step = _per_seq_norm(x_new - x)  # (B,)
        x = x_new
        step_max = float(step.max())
        if not math.isfinite(step_max):
            status = "diverged"
            break
        if first is None:
            first = step_max
            if certified and atol > 0:
                predicted = banach_iterations(lipschitz, first, atol)  # type: ignore[arg-type]
        elif first > 0 and step_max > 1e6 * first:
            status = "diverged"
            break
        if not certified:
            # Without a contraction constant a small step proves nothing; keep iterating so
            # that a divergent or cycling iteration shows itself.
            continue
        seq_bound = step * factor  # (B,)
        bound = float(seq_bound.max())
        if bool((seq_bound <= atol).all()):
            status = "atol"
            break
        if rtol > 0 and bool((seq_bound <= rtol * _per_seq_norm(x)).all()):
            status = "rtol"
            break
    residual = float(_per_seq_norm(x + g(x) - y).max()) if status != "diverged" else math.inf
    converged = certified and status in ("atol", "rtol")
    if converged:
        msg = f"converged in {it} iterations; error bound {bound:.3g}"
    elif not certified:
        msg = ("the residual branch has no certified Lipschitz constant < 1, so the fixed-point "
               f"iteration has no convergence guarantee; it ended with status {status!r} after "
               f"{it} iterations (residual {residual:.3g}): no inverse is returned")
        bound = math.inf
    else:
        msg = (f"no convergence within max_iter={max_iter} iterations (error bound "
               f"{bound:.3g}); raise max_iter or loosen atol/rtol")
    return InverseResult(x, it, bound, converged, status, lipschitz, predicted, residual, msg)


@dataclass(frozen=True)
class ContractiveTrunkConfig:
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    max_len: int
    c: float = 0.9
    causal: bool = True
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = "relu"

    def __post_init__(self) -> None:
        if not isinstance(self.n_layers, int) or isinstance(self.n_layers, bool) \
                or self.n_layers < 1:
            raise ConfigError("n_layers", f"must be a positive integer, got {self.n_layers!r}")
        self.attention_config()
        self.ffn_config()

    def attention_config(self) -> ContractiveL2Config:
        return ContractiveL2Config(self.d_model, self.n_heads, self.max_len, self.c, self.causal)

    def ffn_config(self) -> ContractiveFFNConfig:
        return ContractiveFFNConfig(self.d_model, self.d_ff, self.c, self.activation)


@dataclass
class TrunkInverseResult:
    x: Tensor
    converged: bool
    error_bound: float  # bound on max over sequences ||x - X*||_F for the whole trunk
    blocks: list[InverseResult] = field(default_factory=list)
    message: str = ""

    @property
    def iterations(self) -> int:
        return sum(b.iterations for b in self.blocks)

    def unwrap(self) -> Tensor:
        if not self.converged:
            raise NotInvertibleError(self.message)
        return self.x


class ContractiveTrunk(nn.Module):
    """`n_layers` x (contractive L2 attention block, contractive FFN block): (B,N,D)->(B,N,D)."""

    def __init__(self, config: ContractiveTrunkConfig) -> None:
        super().__init__()
        self.config = config
        blocks: list[nn.Module] = []
        for _ in range(config.n_layers):
            blocks.append(ContractiveL2Block(config.attention_config()))
            blocks.append(ContractiveFFNBlock(config.ffn_config()))
        self.blocks = nn.ModuleList(blocks)

    def residual_blocks(self) -> list[ResidualBlock]:
        return [b for b in self.blocks if isinstance(b, ResidualBlock)]

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        for blk in self.blocks:
            x = blk(x)
        return x

    def branch_constants(self, seq_len: int | None = None) -> list[float]:
        return [float(b.lipschitz_upper(seq_len)) for b in self.residual_blocks()]  # type: ignore[arg-type]

    def lipschitz_upper(self, seq_len: int | None = None) -> float:
        """`prod (1 + Lip(g_l))`, rounded up."""
        return mul_up(*(add_up(1.0, c) for c in self.branch_constants(seq_len)))

    def inverse_lipschitz_upper(self, seq_len: int | None = None) -> float:
        """`prod 1 / (1 - Lip(g_l))`, rounded up (inf when some branch is not contractive)."""
        out = 1.0
        for c in self.branch_constants(seq_len):
            if c >= 1.0:
                return math.inf
            out = mul_up(out, div_up(1.0, math.nextafter(1.0 - c, 0.0)))
        return out

    def inverse(self, y: Tensor, atol: float = 1e-6, rtol: float = 0.0,
                max_iter: int = 1000) -> TrunkInverseResult:
        """Invert block by block in reverse. The error bound accumulates as
        `E_{l-1} <= b_l + E_l / (1 - c_l)`: block l's own Banach bound plus the error of its
        input, amplified by at most `Lip(G_l^{-1}) <= 1/(1 - c_l)`."""
        results: list[InverseResult] = []
        total = 0.0
        x = y
        for i, blk in reversed(list(enumerate(self.residual_blocks()))):
            res = blk.inverse(x, atol=atol, rtol=rtol, max_iter=max_iter)
            results.insert(0, res)
            if not res.converged:
                return TrunkInverseResult(res.x, False, math.inf, results,
                                          f"block {i}: {res.message}")
            c = res.lipschitz if res.lipschitz is not None else 1.0
            total = add_up(res.error_bound, div_up(total, math.nextafter(1.0 - c, 0.0)))
            x = res.x
        return TrunkInverseResult(x, True, total, results,
                                  f"converged; trunk error bound {total:.3g}")


def trunk_logdet_estimate(trunk: ContractiveTrunk, x: Tensor, n_terms: int = 10,
                          n_samples: int = 16,
                          generator: torch.Generator | None = None) -> LogDetEstimate:
    """`log det J_trunk(x)` = sum over blocks of `log det(I + J_g)` at each block's input
    (chain rule); independent probes per block, so the standard errors add in quadrature."""
    value = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)  # (B,)
    var = torch.zeros_like(value)
    trunc = 0.0
    h = x
    for blk in trunk.residual_blocks():
        est = logdet_estimate(blk.branch, h, n_terms, n_samples, blk.lipschitz_upper(h.shape[1]),
                              generator)
        value, var = value + est.value, var + est.stderr**2
        trunc += est.truncation_bound
        with torch.no_grad():
            h = blk(h)
    return LogDetEstimate(value, var.sqrt(), trunc, n_terms, n_samples)


@contextmanager
def frozen_scales(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, contractive scales are fixed python floats (their certified values),
    so the model can be traced for ONNX export and evaluated without re-checking weights."""
    blocks = [m for m in model.modules()
              if isinstance(m, (ContractiveL2Block, ContractiveFFNBlock))]
    try:
        for m in blocks:
            if isinstance(m, ContractiveL2Block):
                m.frozen = m._certified()[1]
            else:
                _, _, a, b = m._certified()
                m.frozen = (a, b)
        yield model
    finally:
        for m in blocks:
            m.frozen = None


def logdet_estimate(g: Callable[[Tensor], Tensor], x: Tensor, n_terms: int = 10,
                    n_samples: int = 16, lipschitz: float | None = None,
                    generator: torch.Generator | None = None) -> LogDetEstimate:
    """Estimate `log det(I + J_g(x))` per sequence by the power series
    `sum_{k=1}^{n_terms} (-1)^{k+1} tr(J_g^k) / k` with Hutchinson traces `v^T J^k v`
    (Rademacher v; `v^T J^k` by repeated vector-Jacobian products).

    Returns the mean over `n_samples` probes, its standard error, and (given the branch's
    Lipschitz constant c < 1) a bound on the truncation bias,
    `|sum_{k>n} tr(J^k)/k| <= ND c^{n+1} / ((n+1)(1-c))`. The series converges only when
    the spectral radius of J_g is < 1, which Lip(g) < 1 guarantees.
    """
    if n_terms < 1 or n_samples < 2:
        raise ValueError("n_terms must be >= 1 and n_samples >= 2")
    b = x.shape[0]
    # All probes in one batch: g acts on each sequence separately, so repeating x along the
    # batch gives every probe its own copy of J and one vjp per term serves them all.
    x_rep = x.detach().repeat(n_samples, *([1] * (x.dim() - 1)))  # (S*B, N, D)
    _, vjp_fn = torch.func.vjp(g, x_rep)[:2]
    v = torch.randint(0, 2, x_rep.shape, generator=generator, dtype=torch.int64,
                      device="cpu").to(device=x.device, dtype=x.dtype) * 2 - 1  # (S*B, N, D)
    w = v
    est = torch.zeros(x_rep.shape[0], dtype=x.dtype, device=x.device)  # (S*B,)
    for k in range(1, n_terms + 1):
        w = vjp_fn(w)[0]  # v^T J^k, (S*B, N, D)
        est = est + ((-1.0) ** (k + 1)) * (w * v).flatten(1).sum(1) / k
    s = est.view(n_samples, b)  # (S, B)
    mean = s.mean(0)
    stderr = s.std(0, unbiased=True) / math.sqrt(n_samples)
    trunc = math.inf
    if lipschitz is not None and lipschitz < 1.0:
        nd = x[0].numel()
        trunc = nd * lipschitz ** (n_terms + 1) / ((n_terms + 1) * (1.0 - lipschitz))
    return LogDetEstimate(mean.detach(), stderr.detach(), trunc, n_terms, n_samples)


@dataclass
class LogDetEstimate:
    value: Tensor  # (B,)
    stderr: Tensor  # (B,)
    truncation_bound: float
    n_terms: int
    n_samples: int


def _register_rules() -> None:
    """Let `bounds.certify` read the certificates of these blocks."""

    @register_rule(ContractiveL2Block, ContractiveFFNBlock)
    class ContractiveBlockRule:
        def bound(self, module: ResidualBlock, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            kind = ("contractive_l2_block" if isinstance(module, ContractiveL2Block)
                    else "contractive_ffn_block")
            if norm != "2":
                reason = (f"{name or 'block'}: contractive blocks are scaled by their 2-norm "
                          "bound; certify them with norm '2'")
                return Bound(None, "not_certified", None,
                             [LayerBound(name, kind, None, "not_certified", reason)], reason)
            with torch.no_grad():
                branch = module.lipschitz_upper(domain.seq_len)
            assert branch is not None
            upper = add_up(1.0, branch)
            return Bound(upper, "certified", None, [LayerBound(name, kind, upper)])

    @register_rule(ContractiveTrunk)
    class ContractiveTrunkRule:
        def bound(self, module: ContractiveTrunk, name: str, norm: NormName, domain: Domain,
                  analyzer: Analyzer) -> Bound:
            prefix = f"{name}." if name else ""
            parts = [analyzer.bound(b, f"{prefix}blocks.{i}", domain)
                     for i, b in enumerate(module.blocks)]
            return compose(parts)


_register_rules()

__all__ = [
    "ContractiveFFNBlock",
    "ContractiveFFNConfig",
    "ContractiveL2Block",
    "ContractiveL2Config",
    "ContractiveTrunk",
    "ContractiveTrunkConfig",
    "DPResidualBlock",
    "InverseResult",
    "LogDetEstimate",
    "NonFiniteWeightsError",
    "NotInvertibleError",
    "ResidualBlock",
    "TrunkInverseResult",
    "banach_iterations",
    "fixed_point_inverse",
    "frozen_scales",
    "logdet_estimate",
    "trunk_logdet_estimate",
]
