"""Certified invertible residual blocks `X + g(X)` with `Lip_2(g) <= c < 1`: contractive L2
attention and contractive FFN (`blocks`), scaled outside training by a certified bound of the
branch for the current weights and in training by estimated spectral norms (`estimate`); the
inverse by Banach's fixed point (`inverse`); the contractive trunk (`trunk`). docs/theory.md,
"Invertible (contractive) self-attention"; docs/certification.md, "Contractive (invertible)
blocks".
"""

from __future__ import annotations

from . import rules  # noqa: F401  (registers the blocks' lowering rules)
from .blocks import ContractiveFFNBlock, ContractiveL2Block, DPResidualBlock, frozen_scales
from .common import ContractiveFFNConfig, ContractiveL2Config, NonFiniteWeightsError
from .inverse import NotInvertibleError, banach_iterations, fixed_point_inverse
from .logdet import logdet_estimate
from .trunk import ContractiveTrunk, ContractiveTrunkConfig, trunk_logdet_estimate

__all__ = [
    "ContractiveFFNBlock",
    "ContractiveFFNConfig",
    "ContractiveL2Block",
    "ContractiveL2Config",
    "ContractiveTrunk",
    "ContractiveTrunkConfig",
    "DPResidualBlock",
    "NonFiniteWeightsError",
    "NotInvertibleError",
    "banach_iterations",
    "fixed_point_inverse",
    "frozen_scales",
    "logdet_estimate",
    "trunk_logdet_estimate",
]
