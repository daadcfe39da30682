"""The local bound engine: Jacobian enclosures over a ball around one input, op by op.

values.py (the value type), primitives.py (enclosure arithmetic), rules.py (one local rule
class per op family, in a registry), layernorm.py (LayerNorm's Jacobian enclosed directly),
fused.py (elementwise chains as one function), structured.py (factored output norms),
forward_error.py (the forward margin proven a posteriori), driver.py (the graph driver:
local_jacobian; centre.py its forward pass at X0, jacobian_walk.py its walk, telescope.py
the telescoped remainder), margins.py (the margins from the affine forms alone),
local.py (the public functions: certify_local, robustness), rules_conv.py and
rules_more.py (more ops, registered into the same registry after rules.py). Derivations:
docs/local-bounds.md.
"""

from __future__ import annotations

from . import rules_conv, rules_more  # noqa: F401  (Conv; masks, Where, ReduceMax, tanh-Gelu)
from .driver import LocalJacobian, center_sha256, check_center, local_jacobian
from .values import Ball, LocalNotCertified, LocalValue

__all__ = ["Ball", "LocalJacobian", "LocalNotCertified", "LocalValue", "center_sha256",
           "check_center", "local_jacobian"]
