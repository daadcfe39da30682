"""A stack of contractive blocks: constants, block-by-block inverse, log-determinant."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from ..bounds.numerics import add_up, div_up, mul_up
from ..config import ConfigError
from .blocks import ContractiveFFNBlock, ContractiveL2Block, ResidualBlock
from .common import ContractiveFFNConfig, ContractiveL2Config
from .estimate import run_estimates
from .inverse import InverseResult, NotInvertibleError
from .logdet import LogDetEstimate, logdet_estimate


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
        blocks = self.residual_blocks()
        estimates = [b.training_estimate() for b in blocks]
        if all(e is not None for e in estimates):
            # Training mode: the norm estimates of every block in one batched call (the
            # weights do not change during a forward), then each block with its own norms.
            ready = [e for e in estimates if e is not None]
            # (The blocks' own forward is bypassed here, and with it any forward hooks on
            # them; eval-mode forwards always go through it.)
            for blk, est, norms in zip(blocks, ready, run_estimates(ready), strict=True):
                x = x + blk.branch_estimated(x, est, norms)
            return x
        for module in self.blocks:
            x = module(x)
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
