"""The local bound engine: Jacobian enclosures over a ball around one input, op by op.

values.py (the value type), enclosure/primitives.py (enclosure arithmetic), enclosure/rules.py (one
local rule class per op family, in a registry), enclosure/layernorm.py (LayerNorm's Jacobian
enclosed directly), elementwise_chains.py (elementwise chains as one function),
remainders/structured_norms.py (factored output norms), rounding/forward_error.py (the forward
margin proven a posteriori), drivers/jacobian.py (the graph driver: local_jacobian;
drivers/centre.py its forward pass at X0, drivers/jacobian_walk.py its walk, remainders/telescope.py
the telescoped remainder), drivers/margins.py (the margins from the affine forms alone),
routes/certify.py (the public functions: certify_local, robustness), enclosure/rules_conv.py and
enclosure/rules_more.py (more ops, registered into the same registry after enclosure/rules.py).
Derivations: docs/local-bounds.md.
"""

from __future__ import annotations

from lsa_models.engine.drivers.jacobian import (
    LocalJacobian,
    center_sha256,
    check_center,
    local_jacobian,
)

# registered into the enclosure's rule registry on import: Conv; masks, Where, ReduceMax, tanh-Gelu
from lsa_models.engine.enclosure import rules_conv, rules_more  # noqa: F401
from lsa_models.engine.values import Ball, LocalNotCertified, LocalValue

__all__ = ["Ball", "LocalJacobian", "LocalNotCertified", "LocalValue", "center_sha256",
           "check_center", "local_jacobian"]
