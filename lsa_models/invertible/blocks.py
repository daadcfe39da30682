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
)
from .estimate import PowerState, TrainingEstimate, estimate_norms, run_estimates
from .inverse import InverseResult, fixed_point_inverse

# The spectral norms each 2-norm candidate of `bounds.formulas.l2_mha_candidates` uses.
_L2_NORMS_NEEDED = {"theorem_3_2": ("q", "v", "o"), "per_head": ("q", "m", "o"),
                    "head_sum": ("q", "b"), "concat": ("q_all", "b_stack")}


def _candidate_value(name: str, s: dict[str, Tensor], d: int) -> Tensor:
    """The weight factor of one 2-norm candidate of `l2_mha_candidates` (without the lead
    factor `L`) from the spectral norms `s` of `_L2_NORMS_NEEDED[name]`."""
    if name == "theorem_3_2":
        # ||W^Q||^4: the corrected weight term of bounds.formulas._two_norm_weights
        return torch.sqrt((s["q"]**4 * s["v"]**2).sum()) * s["o"] / math.sqrt(d)
    if name == "per_head":
        return s["o"] * torch.sqrt(((s["q"] * s["m"]) ** 2).sum())
    if name == "head_sum":
        return (s["q"] * s["b"]).sum()
    return s["q_all"] * s["b_stack"]


def _needed(names: tuple[str, ...]) -> list[str]:
    return sorted({k for n in names for k in _L2_NORMS_NEEDED[n]})


def _training_mode(block: nn.Module, weight: Tensor, frozen: object, enabled: bool) -> bool:
    """Training mode with the cheap estimate: scales `c / U_est`, differentiable."""
    return (frozen is None and block.training and enabled and torch.is_grad_enabled()
            and weight.requires_grad)


class ResidualBlock(nn.Module):
    """`G(X) = X + g(X)` with `branch = g`; `lipschitz_upper()` is Lip_2(g) or None.

    Contractive blocks in training mode also offer `training_estimate()` (None elsewhere)
    and `branch_estimated(x, estimate, norms)`, `norms` the estimated spectral norms of
    `estimate.mats` (`estimate.run_estimates`, one batched call for a whole trunk):
    `branch(x)` is exactly that with this block's norms estimated on their own."""

    def branch(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def training_estimate(self) -> TrainingEstimate | None:
        return None

    def branch_estimated(self, x: Tensor, estimate: TrainingEstimate,
                         norms: list[Tensor]) -> Tensor:
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
    formula on estimates of the spectral norms (`estimate.estimate_norms_warm`): cheap and
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
        self.power = PowerState()  # warm-start vectors of the training estimate

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

    def _norm_inputs(self, need: list[str], folded: Tensor | None) -> list[Tensor]:
        """The float32 matrices whose spectral norms the candidates use, in `need`'s order;
        `folded`: `attn.folded_output_weight()` when the caller has it already (it is
        `[B_1; ..; B_H]`, the stacked `M_h W^O_h`)."""
        a = self.attn
        h, d = self.config.n_heads, self.config.d_model // self.config.n_heads
        with torch.autocast(a.q_proj.weight.device.type, enabled=False):
            if folded is None and ("b" in need or "b_stack" in need):
                folded = a.folded_output_weight().float()  # (D, D)
            mats: dict[str, Tensor] = {"q_all": a.q_proj.weight.float()}  # (D, D)
            if "q" in need or "m" in need:
                mats["q"] = a.query_weights().float()  # (H, D, d)
            if "v" in need:
                mats["v"] = a.value_weights().float()  # (H, D, d)
            if "o" in need:
                mats["o"] = a.output_weight().float()  # (D, D)
            if "m" in need:
                mats["m"] = torch.einsum("hke,hkf->hef", mats["q"],
                                         a.value_weights().float()) / math.sqrt(d)  # (H, d, d)
            if folded is not None:
                mats["b"] = folded.reshape(h, d, -1)  # (H, d, D) = M_h W^O_h
                mats["b_stack"] = folded  # (H d, D)
        return [mats[k] for k in need]

    def _u_from(self, names: tuple[str, ...], norms: list[Tensor]) -> Tensor:
        """The smallest candidate in `names` from the spectral norms of `_norm_inputs`."""
        d = self.config.d_model // self.config.n_heads
        s = dict(zip(_needed(names), norms, strict=True))
        values = [_candidate_value(n, s, d) for n in names]
        lead = _lead(self.config.max_len, self.config.causal)
        return lead * (values[0] if len(values) == 1 else torch.stack(values).min())

    def _torch_u(self, exact: bool, names: tuple[str, ...],
                 folded: Tensor | None = None) -> Tensor:
        """The certified formula in torch (differentiable): the smallest of the 2-norm
        `l2_mha_candidates` in `names`, spectral norms by SVD (`exact`) or by
        `estimate_norms`; only the matrices and norms those candidates use are computed."""
        mats = self._norm_inputs(_needed(names), folded)
        norms = [_spec_norms(m) for m in mats] if exact else estimate_norms(mats)
        return self._u_from(names, norms)

    def _surrogate_u(self) -> Tensor:
        """`_torch_u` with exact (SVD) spectral norms, on `bound_names` (default: all but
        Theorem 3.2, which `per_head` never exceeds)."""
        return self._torch_u(True, self.bound_names or ("per_head", "head_sum", "concat"))

    def estimated_u(self) -> Tensor:
        """`_torch_u` with `estimate_norms` (Rayleigh quotients: an estimate from below) on
        `training_bounds` (or `bound_names` when set)."""
        return self._torch_u(False, self._training_names())

    def _training_names(self) -> tuple[str, ...]:
        return self.bound_names or self.training_bounds

    def training_estimate(self) -> TrainingEstimate | None:
        """Training mode: the folded output matrix (the forward's, and the `concat`
        candidate's stacked B) and the matrices the training scale's norms are taken of."""
        a = self.attn
        if not _training_mode(self, a.q_proj.weight, self.frozen, self.estimate_in_training):
            return None
        with torch.autocast(a.q_proj.weight.device.type, enabled=False):
            folded = a.folded_output_weight()  # (D, D), in the weights' dtype
        mats = self._norm_inputs(_needed(self._training_names()), folded.float())
        return TrainingEstimate(mats, self.power, folded)

    def branch_estimated(self, x: Tensor, estimate: TrainingEstimate,
                         norms: list[Tensor]) -> Tensor:  # (B, N, D)
        """`c F(X) / U_est`. The scale multiplies the (D, D) folded matrix and the bias
        instead of the (B, N, D) output: the same map up to rounding, and nothing certified
        is computed from a training-mode forward."""
        self._check_length(x)
        a, folded = self.attn, estimate.operand
        assert folded is not None
        # NaN weights give a NaN scale and loss here; train_lm stops on it.
        s = self.config.c / self._u_from(self._training_names(), norms)
        return nn.functional.linear(a.attend(x), (folded * s).transpose(0, 1),
                                    a.out_proj.bias * s)  # (B, N, D)

    def scale(self) -> Tensor | float:
        """The factor multiplying F(X). Training: `c / U_est` (differentiable; the stateless
        `estimated_u`, which a training forward's warm-started estimate refines). Otherwise
        the certified value `<= c / U_cert` (with grad but not training: that value, with the
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

    def _check_length(self, x: Tensor) -> None:
        if x.shape[1] > self.config.max_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds the certified max_len="
                             f"{self.config.max_len}")

    def branch(self, x: Tensor) -> Tensor:  # (B, N, D)
        self._check_length(x)
        est = self.training_estimate()
        if est is not None:
            return self.branch_estimated(x, est, run_estimates([est])[0])
        return self.attn(x) * self.scale()  # (B, N, D)


class ContractiveFFNBlock(ResidualBlock):
    """Token-wise `x + c (W2/s2) act((W1/s1) x + b1) / L_act + b2`, s_i certified norms
    (training mode: warm-started power-iteration estimates, as in `ContractiveL2Block`)."""

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
        self.power = PowerState()  # warm-start vectors of the training estimate

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
        """(a, b) multiplying `W1 x` and `W2 h`: training, `1/s1` and `c/(L_act s2)` on the
        stateless estimates (a training forward refines them warm); otherwise certified, as
        `ContractiveL2Block.scale`."""
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

    def training_estimate(self) -> TrainingEstimate | None:
        """Training mode: the two weights whose norms set the scales."""
        if not _training_mode(self, self.fc1.weight, self.frozen, self.estimate_in_training):
            return None
        return TrainingEstimate([self.fc1.weight.float(), self.fc2.weight.float()], self.power)

    def branch_estimated(self, x: Tensor, estimate: TrainingEstimate,
                         norms: list[Tensor]) -> Tensor:  # (B, N, D)
        """Scales `1/s1`, `c/(L_act s2)` on the (F, D) and (D, F) weights instead of the
        (B, N, F) and (B, N, D) products (fused with the biases): the same map up to
        rounding, and nothing certified is computed from a training-mode forward."""
        s1, s2 = norms
        lact = ACTIVATION_LIPSCHITZ[self.config.activation]
        h = self.act(nn.functional.linear(x, self.fc1.weight / s1, self.fc1.bias))  # (B, N, F)
        return nn.functional.linear(h, self.fc2.weight * (self.config.c / (lact * s2)),
                                    self.fc2.bias)  # (B, N, D)

    def lipschitz_upper(self, seq_len: int | None = None) -> float:
        s1, s2, a, b = self._certified()
        lact = ACTIVATION_LIPSCHITZ[self.config.activation]
        return mul_up(a, s1, lact, b, s2)  # token-wise: same constant on sequences

    def branch(self, x: Tensor) -> Tensor:  # (B, N, D)
        # Scale the products, not the weights: the certified map is then exactly
        # `a W1 x` with the stored W1 (a rounded weight copy fl(a W1) would not be).
        est = self.training_estimate()
        if est is not None:
            return self.branch_estimated(x, est, run_estimates([est])[0])
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
