"""The one error a certification route raises or passes on where it does not apply to a
graph, ball or input (routes/table.py): its number is then absent and the other routes stand. Any
other exception is a fault and propagates."""

from __future__ import annotations

from lsa_models.engine.affine.form import NotAffine
from lsa_models.engine.derived.tangent import NoTangent
from lsa_models.engine.values import LocalNotCertified


class RouteNotApplicable(Exception):
    """A route does not apply here (no rule for a node, a ball too wide, a size past its
    limit): no number from it."""


# what the routes' callers catch: the typed error and the engines' own "does not apply"
# errors (no tangent or adjoint rule for a node, no affine form, no enclosure of the ball)
NOT_APPLICABLE: tuple[type[Exception], ...] = (RouteNotApplicable, NoTangent, NotAffine,
                                               LocalNotCertified)
