"""deferred.weighted_sums (the margins' weighted sums s_t = sum_i w_ti u_ti, every margin in
one pass) against affine_rules.weighted_sum one margin at a time: the same numbers, bit for
bit, so the margins past a final LayerNorm stay those of the loop it replaces."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.heads import final_layernorm as deferred
from lsa_models.engine.values import Ball
from tests.profile import at_most


def _form(rng: np.random.Generator, shape: tuple[int, ...], width: int) -> Aff:
    a = rng.standard_normal((*shape, width)) * 1e-2
    a[rng.random((*shape, width)) < 0.4] = 0.0  # zero coefficients, as the walks' forms hold
    return Aff(rng.standard_normal(shape), np.abs(rng.standard_normal(shape)) * 1e-12,
               rng.standard_normal(shape) * 1e-3, a, np.abs(rng.standard_normal(shape)) * 1e-3)


def _same(u: Aff, v: Aff) -> None:
    for name in ("c", "m", "o", "a", "b"):
        x, y = getattr(u, name), getattr(v, name)
        assert x.shape == y.shape, name
        assert np.array_equal(x, y), (name, float(np.abs(x - y).max()))


# bit-for-bit against the reference arithmetic: a few dozen random layouts cover the
# branches; the full profile's count only repeats them
@settings(max_examples=at_most(40), deadline=None)
@given(seed=st.integers(0, 10**6), lead=st.sampled_from([(), (1,), (2,)]),
       tokens=st.integers(1, 9), d=st.integers(1, 40), width=st.integers(1, 700),
       margins=st.integers(1, 9), one_token=st.booleans(), norm=st.sampled_from(["inf", "2"]))
def test_weighted_sums_are_weighted_sum_bit_for_bit(seed: int, lead: tuple[int, ...],
                                                    tokens: int, d: int, width: int,
                                                    margins: int, one_token: bool,
                                                    norm: str) -> None:
    """Every weight's sum, with leading axes, many or one token read (the others' weights 0:
    a CLS token's margins), wide and narrow coefficient arrays."""
    rng = np.random.default_rng(seed)
    shape = (*lead, tokens, d)
    p = min(width, 6)
    ball = Ball(np.zeros(p), 0.05, norm)
    u = _form(rng, shape, width)
    ws = [rng.standard_normal(shape) for _ in range(margins)]
    if one_token:
        keep = int(rng.integers(tokens))
        for w in ws:
            w[..., [t for t in range(tokens) if t != keep], :] = 0.0
    got = deferred.weighted_sums(u, ws, ball)
    assert len(got) == margins
    for w, s in zip(ws, got, strict=True):
        _same(s, affine_rules.weighted_sum(u, w, ball))

