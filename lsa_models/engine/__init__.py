"""The local bound engine: Jacobian enclosures over a ball around one input, op by op
(layout and derivations: docs/local-bounds.md)."""

# registered into the enclosure's rule registry on import: Conv; masks, Where, ReduceMax, tanh-Gelu
from lsa_models.engine.enclosure import rules_conv, rules_more  # noqa: F401
