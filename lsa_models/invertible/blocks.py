"""Residual blocks `X + g(X)`: contractive L2 attention, contractive FFN, and DP (uncertified)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..attention import L2MHA, DotProductMHA
from ..bounds.formulas import l2_mha_bound, l2_mha_candidates
from ..bounds.numerics import ACTIVATION_LIPSCHITZ, mul_up, spectral_norm_upper
from ..config import AttentionConfig
from .common import (
    _SCALE_MARGIN,
    ContractiveFFNConfig,
    ContractiveL2Config,
    _float32_down,
    _lead,
    _outside_transforms,
    _param_key,
    _require_finite,
    _spec_norms,
    estimate_norms,
)
from .inverse import InverseResult, fixed_point_inverse

# The spectral norms each 2-norm candidate of `bounds.formulas.l2_mha_candidates` uses.
_L2_NORMS_NEEDED = {"theorem_3_2": ("q", "v", "o"), "per_head": ("q", "m", "o"),
                    "head_sum": ("q", "b"), "concat": ("q_all", "b_stack")}


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
    """`X + c F(X) / U(F)` with F a tied L2-MHA and U its certified 2-norm bound
    (`bounds.formulas.l2_mha_bound`: the smallest of the chained bounds and Theorem 3.2).

    In training mode (grad enabled, `self.training`) the scale is `c / U_est`, U_est the same
    formula on estimates of the spectral norms (`common.estimate_norms`): cheap and
    differentiable, but not certified. Everywhere else (eval mode, no grad, `lipschitz_upper`,
    `inverse`, `frozen_scales`, export, certification) the scale is the certified
    `<= c / U_cert`, so `Lip(g) <= c` holds for the weights as they are used there.

    `bound_names` (class attribute; None: all of `l2_mha_candidates`) and
    `estimate_in_training` (False: certified value at every step with an SVD surrogate for the
    gradient, the slower scheme) exist for benchmarks that compare rescaling schemes;
    `training_bounds` names the candidates the training estimate follows.
    """

    bound_names: tuple[str, ...] | None = None
    estimate_in_training: bool = True
    # The candidate(s) the training estimate follows. One keeps a step cheap (two norms);
    # `concat` is the smallest at initialisation in every LM shape measured (about half the
    # others). Outside training the certified minimum of all candidates, never larger, is used.
    training_bounds: tuple[str, ...] = ("concat",)

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
        """The certified 2-norm bound (causal extension when causal) for the current weights:
        the smallest of the candidates in `bound_names`."""
        a = self.attn
        n = self.config.max_len if seq_len is None else seq_len
        args = (a.query_weights(), a.value_weights(), a.output_weight(), n, "2",
                self.config.causal)
        if self.bound_names is None:
            return l2_mha_bound(*args)
        found = l2_mha_candidates(*args)
        return min(found[k] for k in self.bound_names)

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

    def _torch_u(self, exact: bool, names: tuple[str, ...]) -> Tensor:
        """The certified formula in torch (differentiable): the smallest of the 2-norm
        `l2_mha_candidates` in `names`, spectral norms by SVD (`exact`) or by
        `estimate_norms`; only the norms those candidates use are computed."""
        a = self.attn
        h, d = self.config.n_heads, self.config.d_model // self.config.n_heads
        with torch.autocast(a.q_proj.weight.device.type, enabled=False):
            wq, wv = a.query_weights().float(), a.value_weights().float()  # (H, D, d)
            wo = a.output_weight().float()  # (D, D)
            m = torch.einsum("hke,hkf->hef", wq, wv) / math.sqrt(d)  # (H, d, d) = M_h
            b = torch.bmm(m, wo.reshape(h, d, -1))  # (H, d, D) = M_h W^O_h
            mats = {"q": wq, "v": wv, "o": wo, "m": m, "b": b,
                    "q_all": a.q_proj.weight.float(), "b_stack": b.reshape(h * d, -1)}
            need = sorted({k for n in names for k in _L2_NORMS_NEEDED[n]})
            got = (_spec_norms(mats[k]) for k in need) if exact else \
                iter(estimate_norms([mats[k] for k in need]))
            s = dict(zip(need, got, strict=True))
            values = []
            for n in names:
                if n == "theorem_3_2":
                    # ||W^Q||^4: the corrected weight term of bounds.formulas._two_norm_weights
                    values.append(torch.sqrt((s["q"]**4 * s["v"]**2).sum()) * s["o"]
                                  / math.sqrt(d))
                elif n == "per_head":
                    values.append(s["o"] * torch.sqrt(((s["q"] * s["m"]) ** 2).sum()))
                elif n == "head_sum":
                    values.append((s["q"] * s["b"]).sum())
                else:
                    values.append(s["q_all"] * s["b_stack"])
            lead = _lead(self.config.max_len, self.config.causal)
            return lead * torch.stack(values).min()

    def _surrogate_u(self) -> Tensor:
        """`_torch_u` with exact (SVD) spectral norms, on `bound_names` (default: all but
        Theorem 3.2, which `per_head` never exceeds)."""
        return self._torch_u(True, self.bound_names or ("per_head", "head_sum", "concat"))

    def estimated_u(self) -> Tensor:
        """`_torch_u` with `estimate_norms` (Rayleigh quotients: an estimate from below) on
        `training_bounds` (or `bound_names` when set)."""
        return self._torch_u(False, self.bound_names or self.training_bounds)

    def scale(self) -> Tensor | float:
        """The factor multiplying F(X). Training: `c / U_est` (differentiable). Otherwise the
        certified value `<= c / U_cert` (with grad but not training: that value, with the
        gradient of `c / U_surrogate`)."""
        if self.frozen is not None:
            return self.frozen
        w = self.attn.q_proj.weight
        if torch.is_grad_enabled() and w.requires_grad:
            if self.training and self.estimate_in_training:
                # NaN weights give a NaN scale and loss here; train_lm stops on it.
                return self.config.c / self.estimated_u()
            _, s = self._certified()
            sur = self.config.c / self._surrogate_u()
            return (sur - sur.detach()) + s  # forward value exactly s
        return self._certified()[1]

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
    """Token-wise `x + c (W2/s2) act((W1/s1) x + b1) / L_act + b2`, s_i certified norms
    (training mode: power-iteration estimates, as in `ContractiveL2Block`)."""

    estimate_in_training: bool = True

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
        w = self.fc1.weight
        lact = ACTIVATION_LIPSCHITZ[self.config.activation]
        if torch.is_grad_enabled() and w.requires_grad and self.training \
                and self.estimate_in_training:
            with torch.autocast(w.device.type, enabled=False):
                s1, s2 = estimate_norms([self.fc1.weight.float(), self.fc2.weight.float()])
            return 1.0 / s1, self.config.c / (lact * s2)
        _, _, a, b = self._certified()
        if torch.is_grad_enabled() and w.requires_grad:
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
