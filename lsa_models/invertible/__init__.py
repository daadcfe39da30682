"""Certified invertible residual blocks: contractive L2 attention and contractive FFN.

docs/theory.md, "Invertible (contractive) self-attention": `G(X) = X + g(X)` is invertible when
`Lip_2(g) <= c < 1`. Outside training (eval mode, no grad, `lipschitz_upper`, `inverse`,
`frozen_scales`, `certify`) every block scales its branch by a factor computed from a
certified float64 upper bound of the branch's Lipschitz constant for the *current* weights:

- `ContractiveL2Block`: `g(X) = c F(X) / U(F)`, F a tied L2-MHA (causal or not), U the
  certified 2-norm bound `bounds.formulas.l2_mha_bound` (the chained bound or Theorem 3.2,
  whichever is smaller) at the block's `max_len` (it grows with N, so it covers every
  shorter sequence too).
- `ContractiveFFNBlock`: `g(x) = c (W2/s2) act((W1/s1) x + b1) / L_act + b2` per token, with
  s1, s2 certified spectral norms and L_act the activation's Lipschitz constant.

Training mode (grad on, `module.train()`) uses the same formulas on estimated spectral norms
(`estimate`: warm-started power iteration, one step per training step, one batched call per
trunk): cheap and differentiable, not certified; the certificate is always computed on the
final weights with the certified factor (docs/certification.md, "Contractive (invertible)
blocks").

The inverse is Banach's fixed point `X_{k+1} = Y - g(X_k)` with the a-posteriori bound
`||X_k - X*|| <= c/(1-c) ||X_k - X_{k-1}||` (Frobenius norm per sequence). A residual block
with no certified constant (dot-product attention, Theorem 3.1) gets no bound, and its
iteration is reported as failed, never returned as if it were an inverse.
"""

from __future__ import annotations

from .blocks import (
    ContractiveFFNBlock,
    ContractiveL2Block,
    DPResidualBlock,
    ResidualBlock,
    frozen_scales,
)
from .common import ContractiveFFNConfig, ContractiveL2Config, NonFiniteWeightsError
from .inverse import InverseResult, NotInvertibleError, banach_iterations, fixed_point_inverse
from .logdet import LogDetEstimate, logdet_estimate
from .rules import _register_rules
from .trunk import (
    ContractiveTrunk,
    ContractiveTrunkConfig,
    TrunkInverseResult,
    trunk_logdet_estimate,
)

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
