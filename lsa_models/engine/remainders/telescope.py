"""The telescoped remainder of a tensor's Jacobian enclosure: the exact adjoints at X0
(autograd) times each op's remainder term (values.py, `OpRemainder.term`), summed over the ops
before the tensor; with the factored (remainders/structured_norms.py), signed
(remainders/signed_adjoints.py), operator-norm (remainders/operator_norms.py) and second-order
(remainders/second_order.py) forms of the same terms.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from lsa_models.bounds.numerics import U, add_up, spectral_norm_upper
from lsa_models.engine.remainders import second_order, signed_adjoints
from lsa_models.engine.remainders.operator_norms import rows_bound, set_token_radius
from lsa_models.engine.remainders.structured_norms import (
    Structured,
    row_two_bounds,
    structured_bounds,
)
from lsa_models.engine.values import Ball, LocalValue, Values, center_margin, enclose, widen_up
from lsa_models.onnx.loading import OnnxModel

# entries of Telescope.plain_memo before it starts afresh (a walk asks for ~100 terms)
PLAIN_MEMO = 512
# Relative allowance on the adjoints G computed by autograd in float64 at the centre (they
# only scale remainder terms): far above float64 backward-pass rounding.
ADJOINT_MARGIN = 1e-9


def adjoint_rows(target: torch.Tensor, ts: list[torch.Tensor]) -> list:
    """d target[i] / d t for every entry i and tensor t (None where t does not reach it):
    one batched backward pass (vmap over the rows of the identity), or row by row where an
    op has no batching rule."""
    k = target.numel()
    try:
        eye = torch.eye(k, dtype=target.dtype)
        grads = torch.autograd.grad(target, ts, grad_outputs=eye, retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        return [tuple(None if gr is None else gr[i] for gr in grads) for i in range(k)]
    except RuntimeError:
        return [torch.autograd.grad(target[i], ts, retain_graph=True, allow_unused=True)
                for i in range(k)]


class Telescope:
    """The remainder of a tensor's Jacobian by telescoping over the ops before it:
    J_t(X) - J_t(X0) = sum_ops G_op (D_op(X) - D_op(X0)) J_in(X), G_op = d t / d (op output)
    at X0 (downstream ops at the centre, their cancellations kept), each op's term from its
    local rule; plus the rounding of the centre Jacobian (the enclosure at eps = 0)."""

    def __init__(self, model: OnnxModel, x: np.ndarray, zero: Values) -> None:
        module = model.module.with_dtype(torch.float64)
        self.xt = torch.from_numpy(x).requires_grad_(True)
        self.env = module.run_env(self.xt)
        self.zero = zero
        # the adjoint rows of the last (tensor, ops) asked for: the output is asked several
        # times (entrywise, margins, structured)
        self.cache: dict[tuple[str, tuple[str, ...]], list] = {}
        self.signed_terms = True
        self.output = model.spec.output_name
        self.terms_memo: list[tuple[tuple, tuple, list]] = []
        # u.term(ga) per (term, adjoint bound): tighten asks for the same product three times
        # on the 2-ball (remainder, row bounds, operator-norm rows)
        self.plain_memo: dict[tuple[int, int], tuple[object, np.ndarray, np.ndarray]] = {}

    def _terms(self, name: str, values: Values, combos: np.ndarray | None) -> list | None:
        """(|G| with its margin, the op's value, G) per op with a remainder term, G the
        adjoint of `name` (or of combos @ name) w.r.t. the op's output at X0. The last two
        answers are kept: tighten, the margins and structured ask for the same terms, and the
        signed forms (signed_adjoints.bind) are the hot path."""
        z = self.zero.get(name)
        if not isinstance(z, LocalValue) or name not in self.env:
            return None
        names = [t for t, u in values.items()
                 if isinstance(u, LocalValue) and u.term is not None and t in self.env]
        if not names:
            return None
        # keyed by the value objects themselves (held by the memo, so compared by identity
        # without an id being reused): a tensor tightened since, or walked on another ball
        # (the halvings), is a new LocalValue
        vals = tuple(values[t] for t in names)
        memo_key = (name, tuple(names),
                    None if combos is None else (combos.shape, combos.tobytes()),
                    self.signed_terms)
        for k, held, got in self.terms_memo:
            if k == memo_key and all(a is b for a, b in zip(held, vals, strict=True)):
                return got
        key = (name, tuple(names))
        if key not in self.cache:
            target = self.env[name].reshape(-1)
            ts = [self.env[t] for t in names]
            self.cache = {key: adjoint_rows(target, ts)}
        rows = self.cache[key]
        ts = [self.env[t] for t in names]
        # the output's own rows may use the signed forms' larger budget
        # (remainders/signed_adjoints.py)
        cap = signed_adjoints.RELATIONAL_CAP.set(
            signed_adjoints.RELATIONAL_OUTPUT_MAX_ENTRIES if name == self.output else None)
        try:
            out = self._bound_terms(names, ts, rows, values, combos)
        finally:
            signed_adjoints.RELATIONAL_CAP.reset(cap)
        self.terms_memo = [(memo_key, vals, out), *self.terms_memo[:1]]
        return out

    def plain(self, u: LocalValue, ga: np.ndarray) -> np.ndarray:
        """u.term(ga), computed once per (term, |G| bound) pair while both are held (the
        memo keeps them, so their ids are not reused); read-only, as it is shared."""
        term = u.term
        assert term is not None
        key = (id(term), id(ga))
        got = self.plain_memo.get(key)
        if got is not None and got[0] is term and got[1] is ga:
            return got[2]
        res = term(ga)
        res.flags.writeable = False
        if len(self.plain_memo) >= PLAIN_MEMO:
            self.plain_memo.clear()
        self.plain_memo[key] = (term, ga, res)
        return res

    def _bound_terms(self, names: list[str], ts: list[torch.Tensor], rows: list,
                     values: Values, combos: np.ndarray | None) -> list:
        """The (|G| + margin, signed-bound value, G) triples of `_terms` from the adjoint
        rows."""
        out = []
        for j, t in enumerate(names):
            if all(r[j] is None for r in rows):
                continue
            zero_g = np.zeros(tuple(ts[j].shape))
            g = np.stack([zero_g if (gi := r[j]) is None else gi.detach().numpy()
                          for r in rows])
            if combos is not None:
                g = np.tensordot(combos, g, axes=1)  # (M, *S_t)
            ga = np.abs(g) * (1 + ADJOINT_MARGIN) + ADJOINT_MARGIN * float(np.abs(g).max())
            u = values[t]
            assert isinstance(u, LocalValue) and u.term is not None
            # the signed form where a rule has one
            b = signed_adjoints.bind(u, g, ga) if self.signed_terms else u
            out.append((ga, b, g))
        return out

    def opnorm(self, name: str, values: Values, combos: np.ndarray | None = None,
               groups: list[np.ndarray] | None = None) -> np.ndarray | None:
        """Per row of `name` (or of combos @ name) as one matrix when `combos` is None, else
        per combination: a bound on sup ||J(X) - jc||_2 over the 2-ball from the
        operator-norm terms (remainders/operator_norms.py): each op's term is the smaller of its
        opnorm rule (signed adjoint; its rounding margin through the entrywise term) and the 2-norm
        of its entrywise term; plus the rounding of jc. Returns (1,) for the whole matrix, or (M,)
        per combination, or per group of rows (index arrays) when `groups` is given. None: nothing
        to telescope."""
        terms = self._terms(name, values, combos)
        if terms is None:
            return None
        rnd = self._rounding(name, combos)
        if groups is None:
            groups = [np.arange(rnd.shape[0])] if combos is None else \
                [np.array([r]) for r in range(combos.shape[0])]
        try:
            return rows_bound(terms, rnd, groups, ADJOINT_MARGIN, self.plain)
        except (ValueError, np.linalg.LinAlgError):  # a term overflowed: not finite
            return None

    def whole_opnorm(self, name: str, values: Values, ball: Ball) -> float | None:
        """2-ball: the operator-norm remainder of the whole tensor; None otherwise."""
        if ball.norm != "2":
            return None
        rem = self.opnorm(name, values)
        return None if rem is None else float(rem[0])

    def _rounding(self, name: str, combos: np.ndarray | None) -> np.ndarray:
        """|J(X0) - jc| for the rows: the enclosure's radius at eps = 0."""
        z = self.zero[name]
        assert isinstance(z, LocalValue)
        zr = z.jr.reshape(z.center.size, -1)
        return zr if combos is None else np.abs(combos) @ zr

    def remainder(self, name: str, values: Values, ball: Ball,
                  combos: np.ndarray | None = None) -> np.ndarray | None:
        """The telescoped bound on |J_t(X) - jc_t| for every entry of tensor `name`, (k, P);
        with `combos` (M, k), for the rows combos @ t instead (their adjoints combined before
        the absolute values, so cancellations between the entries are kept). None: nothing
        to telescope."""
        terms = self._terms(name, values, combos)
        if terms is None:
            return None
        total = self._rounding(name, combos).copy()
        for ga, u, _ in terms:
            assert u.term is not None
            total += self.plain(u, ga)
        return total * (1 + 1e-12)

    def structured(self, name: str, values: Values, ball: Ball,
                   combos: np.ndarray | None = None) -> Structured | None:
        """Norm bounds on J_t(X) - jc_t from the factored terms (remainders/structured_norms.py)."""
        terms = self._terms(name, values, combos)
        if terms is None:
            return None
        kept = [(ga, u, g) for ga, u, g in terms if u.term is not None]
        tl = [(self.plain(u, ga), None if u.parts is None else u.parts(ga))
              for ga, u, _ in kept]
        zr = self._rounding(name, combos)
        try:
            st = structured_bounds(tl, zr, ball.norm)
        except ValueError:  # a term overflowed (not finite): the entrywise bound stands
            return None
        # inf-ball rows with the signs of the rows' own Jacobians kept
        # (remainders/signed_adjoints.py)
        rem = self.remainder(name, values, ball, combos)
        v = values.get(name)
        st = signed_adjoints.signed_rows(st, tl, zr, v, combos, rem, ball.norm)
        if ball.norm != "inf" or not isinstance(v, LocalValue) or not kept:
            return st
        # and the rows' Hessians at X0 from the ops' second-order rules (remainders/second_order.py)
        jcm, jrr, err = signed_adjoints.row_enclosure(v, combos, rem)
        return second_order.second_rows(st, [(g, ga, u, b) for (ga, u, g), (b, _) in
                                       zip(kept, tl, strict=True)],
                                  widen_up(zr + err, 2), jcm, jrr, ball.eps)

    def tighten(self, name: str, v: LocalValue, values: Values, ball: Ball,
                tokens: bool = False) -> LocalValue:
        total = self.remainder(name, values, ball)
        if total is None:
            return v
        jr = np.minimum(v.jr, total.reshape(v.jr.shape))
        lo, hi = v.lo, v.hi
        nonlin = v.nonlin
        if ball.norm == "inf":  # the entries' second-order enclosure (remainders/second_order.py)
            got = self._second_entries(name, values, ball)
            if got is not None:
                hrow, rest = second_order.hessian_rows(np.abs(got[0])), got[1]
                h = second_order.entry_bounds(hrow, rest, ball.eps)
                if np.all(np.isfinite(h)):
                    jr = np.minimum(jr, h.reshape(v.jr.shape))
                # and the values' (second_order.value_radius)
                rad, nl = second_order.value_radius(hrow, rest, v.jc, ball.eps)
                if np.all(np.isfinite(rad)):
                    rad = widen_up(rad.reshape(v.center.shape) + center_margin(v.center), 2)
                    lo, hi = np.maximum(lo, v.center - rad), np.minimum(hi, v.center + rad)
                    nonlin = (ball.eps, nl.reshape(v.center.shape))
        if ball.norm == "2":
            # values from the structured row bounds: |T_i(X) - T_i(X0) - jc_i d| <=
            # eps sup ||J_i(xi) - jc_i||_2 (mean value theorem; remainders/structured_norms.py)
            terms = self._terms(name, values, None)
            assert terms is not None
            try:
                rows = row_two_bounds([(self.plain(u, ga),
                                        None if u.parts is None else u.parts(ga))
                                       for ga, u, _ in terms if u.term is not None],
                                      self._rounding(name, None))
            except ValueError:  # not finite
                rows = None
            if rows is not None:
                p = v.jc.shape[-1]
                lin = np.sqrt(widen_up(np.square(v.jc.reshape(-1, p)).sum(axis=1), p)) \
                    * (1 + 4 * U)
                rad = widen_up(ball.eps * (lin + rows), 4).reshape(v.center.shape) \
                    + center_margin(v.center)
                lo, hi = np.maximum(lo, v.center - rad), np.minimum(hi, v.center + rad)
        out = enclose(v.center, v.jc, jr, ball, lo, hi)
        # the op's remainder without its factored form (the numbers as they were measured)
        out.remainder = None if v.remainder is None else replace(v.remainder, parts=None)
        out.jfac = v.jfac
        out.nonlin = nonlin
        if ball.norm == "2" and tokens:
            self._norms(name, out, values, ball)
        return out

    def _second_entries(self, name: str, values: Values, ball: Ball
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """inf-ball: the entries' Hessians at X0 and rest (second_order.hessian_rest_factored), from
        the ops' second-order rules: |J_t(X) - jc_t - H[p] . d| <= r entrywise; None where no
        op has one or they would not fit."""
        z = self.zero.get(name)
        if not isinstance(z, LocalValue) or \
                z.center.size * z.jc.shape[-1] ** 2 > second_order.MAX_TENSOR_HESSIAN_ENTRIES:
            return None
        terms = self._terms(name, values, None)
        if terms is None:
            return None
        kept = [(g, ga, u, self.plain(u, ga)) for ga, u, g in terms if u.term is not None]
        got = second_order.hessian_rest_factored(kept, self._rounding(name, None), ball.eps,
                                           second_order.MAX_TENSOR_HESSIAN_ENTRIES)
        return None if got is None else (got[0], got[1])

    def _norms(self, name: str, v: LocalValue, values: Values, ball: Ball) -> None:
        """2-ball: v.jnorm = ||jc||_2 + the operator-norm remainder of the whole tensor, and
        per token t (last axis) v.tok_rad = eps (||jc_t||_2 + remainder of its rows) + the
        centre's margin (mean value theorem: ||T_t(X) - T_t(X0)|| <= eps sup ||J_t||_2)."""
        d = v.shape[-1] if v.shape else 1
        k = v.center.size
        rows = np.arange(k)
        groups = [rows] + [rows[i:i + d] for i in range(0, k, d)]
        rem = self.opnorm(name, values, None, groups)
        if rem is None:
            return
        p = v.jc.shape[-1]
        jc = v.jc.reshape(k, p)
        v.jnorm = add_up(spectral_norm_upper(jc), float(rem[0]))
        if not v.shape:
            return
        tok = np.array([add_up(spectral_norm_upper(jc[i:i + d]), float(rem[1 + t]))
                        for t, i in enumerate(range(0, k, d))])
        v.tok_jn = tok.reshape(*v.shape[:-1], 1)
        set_token_radius(v, widen_up(ball.eps * v.tok_jn, 2))

