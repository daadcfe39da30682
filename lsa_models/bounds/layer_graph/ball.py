"""Per-layer local rules on the layer graph: the constant on a 2-ball around one input.

Domain: `{X : ||X - X0||_F <= eps}`. Every input-dependent tensor T carries a `BallValue`:
its centre `T(X0)` (float64), `lip`, an upper bound on `sup ||J_T(X)||_2` over the ball, and
`rho`, one bound per token (last-axis row) on `||t_i(X) - t_i(X0)||_2`. The constant of the
whole map is the output's `lip` (chain rule at every point of the ball; the ball is convex,
so the supremum of the Jacobian norm is the Lipschitz constant on it). Layers use the
centre and the radii instead of a radius from the origin (docs/local-layer-graph.md, "Per-layer
local rules on the layer graph"):

- LayerNorm / RMSNorm: `max|gamma| / sqrt(max(0, ||P c_i|| - rho_i)^2 / D + eps)` per token
  (`P` the mean-removing projection; RMSNorm: `P = I`), the largest over tokens;
- dot-product attention: Theorem-3.1-style ball bound with the key/value spread
  `S = max_j (||c_j - m|| + rho_j)` around the centre tokens' mean `m` and the largest query
  `max_i ||c_i W^Q + b^Q|| + ||W^Q|| rho_i` from the actual centre, instead of `R` = the
  largest token norm; the smaller of it and the global ball bound;
- every other layer: its global rule, the radii mapped token-wise where the layer acts on
  tokens one by one, otherwise `rho_i <= lip * eps` (true of every tensor: each token moves at
  most as far as the whole tensor).

2-norm only. The front end registers the rule of its generic layers (`OpNode`) in
`BALL_FAMILIES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..formulas import dp_mha_ball, l2_mha_bound, layernorm_bound, linear_bound
from ..numerics import (
    LAYER_ACTIVATION_LIPSCHITZ,
    add_up,
    inv_sqrt_up,
    mul_up,
    spectral_norm_upper,
    sqrt_up,
    up,
)
from ..report import LayerBound
from .families import rmsnorm_bound
from .layers import Activation, DPAttention, Identity, L2Attention, Layer, LayerGraph, Norm
from .values import Verdicts

# Relative allowance for the float64 rounding of one layer's centre (docs/local-layer-graph.md,
# "Rounding"): added to every token's radius after every layer, so it is propagated by the
# later layers' constants like any other deviation.
CENTER_MARGIN = 1e-9


class BallNotCertified(Exception):
    """A layer without a local rule on the ball."""


@dataclass
class BallValue:
    center: np.ndarray  # T(X0), float64, (*S,)
    lip: float  # sup of ||J_T||_2 over the ball
    rho: np.ndarray  # (*S[:-1],): per-token deviation bound, >= 0
    bound: float = math.inf  # every token's 2-norm on the ball, by the global rules

    def token_norms(self) -> np.ndarray:
        c = self.center.reshape(-1, self.center.shape[-1]) if self.center.ndim else \
            self.center.reshape(1, 1)
        return np.sqrt(np.square(c).sum(axis=1)).reshape(self.rho.shape)

    def reach(self) -> float:
        """Largest token 2-norm the tensor takes on the ball."""
        return min(up(float((self.token_norms() + self.rho).max()) * (1 + 1e-15)), self.bound)


@dataclass
class Ball:
    eps: float
    acc: Verdicts
    env: Any  # every tensor of the float64 evaluation at X0 (name -> torch tensor)
    # per attention layer (by name): its attention probabilities at X0, (H, N, N)
    probs: dict[str, np.ndarray] = field(default_factory=dict)


def _token_shape(center: np.ndarray) -> tuple[int, ...]:
    return tuple(center.shape[:-1]) if center.ndim else ()


def settle(center: np.ndarray, lip: float, rho: np.ndarray | float, ball: Ball,
           amplify: float = 1.0, in_norms: np.ndarray | float = 0.0,
           bound: float | None = None) -> BallValue:
    """The value of a layer's output: its radii capped by `lip * eps` and widened by the
    rounding allowance of its centre (`amplify * ||input token||` covers cancellation)."""
    shape = _token_shape(center)
    r = np.broadcast_to(np.asarray(rho, dtype=np.float64), shape).copy()
    out = BallValue(center, lip, r, math.inf if bound is None else bound)
    cap = mul_up(lip, ball.eps)
    slack = CENTER_MARGIN * (1.0 + out.token_norms() + amplify * np.asarray(in_norms))
    out.rho = np.minimum(r, cap) * (1 + 1e-15) + slack
    return out


def norm_ball_factors(gamma: Any, eps: float, x: BallValue, rms: bool) -> np.ndarray:
    """Per token, `max|gamma| / sqrt(max(0, ||P c_i|| - rho_i)^2 / D + eps)` rounded up
    (RMSNorm: `||c_i||`): the supremum of the token Jacobian's 2-norm on the token's ball."""
    g = float(np.abs(np.asarray(gamma, dtype=np.float64)).max())
    c = x.center.reshape(-1, x.center.shape[-1])
    dim = c.shape[1]
    centred = c if rms else c - c.mean(axis=1, keepdims=True)
    # the norm of the centred centre token, rounded down (relative 1e-12 covers the sums)
    pn = np.sqrt(np.square(centred).sum(axis=1)) * (1 - 1e-12)
    low = np.maximum(0.0, pn - x.rho.reshape(-1) * (1 + 1e-15))
    var = np.square(low) / dim * (1 - 1e-15) + eps * (1 - 1e-15)
    out = g / np.sqrt(var) * (1 + 4e-16 * 8)
    return out.reshape(x.rho.shape)


def dp_centred_bound(layer: DPAttention, x: BallValue) -> float:
    """`||W^O|| sqrt(sum_h J_h^2)`, `J_h = sqrt(N) ||W^V_h|| + s ||W^V_h|| S ||W^K_h||
    (S ||W^Q_h|| + sqrt(N) Qmax_h)`, S the key/value spread around the centre tokens' mean,
    `Qmax_h` the largest query on the ball (docs/local-layer-graph.md)."""
    c = x.center.reshape(-1, x.center.shape[-1])  # (N, D)
    rho = x.rho.reshape(-1)
    m = c.mean(axis=0)
    spread = up(float((np.sqrt(np.square(c - m).sum(axis=1)) * (1 + 1e-12) + rho).max()))
    heads, _, d = layer.wq.shape
    s = inv_sqrt_up(d) if layer.scale is None else abs(float(layer.scale))
    root_n = sqrt_up(c.shape[0])
    wq = np.asarray(layer.wq, dtype=np.float64)
    bq = None if layer.bq is None else np.asarray(layer.bq, dtype=np.float64).reshape(heads, -1)
    terms = []
    for h in range(heads):
        sq = spectral_norm_upper(layer.wq[h])
        sk = spectral_norm_upper(layer.wk[h])
        sv = spectral_norm_upper(layer.wv[h])
        q = c @ wq[h] + (0.0 if bq is None else bq[h])  # (N, d)
        q_max = up(float((np.sqrt(np.square(q).sum(axis=1)) * (1 + 1e-12)
                          + sq * rho * (1 + 1e-15)).max()))
        sigma_v = mul_up(sv, spread)
        logit = mul_up(s, sigma_v, sk, add_up(mul_up(spread, sq), mul_up(root_n, q_max)))
        terms.append(add_up(mul_up(root_n, sv), logit))
    return mul_up(spectral_norm_upper(layer.wo), sqrt_up(add_up(*(mul_up(t, t)
                                                                     for t in terms))))


def _dp_head_at_center(wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, bq: np.ndarray | float,
                       p0: np.ndarray, c: np.ndarray, rho: np.ndarray, s: float
                       ) -> tuple[float, np.ndarray]:
    """One head around the centre's attention probabilities `p0` (N, N): its Jacobian bound
    on the ball and per-token output deviation bounds (docs/local-layer-graph.md, "Dot-product
    attention around the centre")."""
    sq, sk, sv = (spectral_norm_upper(w) for w in (wq, wk, wv))
    q0 = c @ wq + bq  # (N, d)
    k0 = c @ wk  # (N, d): the key bias drops out (a row constant of the logits)
    v0 = c @ wv  # (N, dv): the value bias cancels in v_j - a_i
    qn = np.sqrt(np.square(q0).sum(axis=1)) * (1 + 1e-12)  # (N,)
    kappa = p0 @ k0  # (N, d): the centre's mean key of each query
    a = p0 @ v0  # (N, dv)
    kd = np.sqrt(np.square(k0[None, :, :] - kappa[:, None, :]).sum(-1)) * (1 + 1e-12)  # (N, N)
    vd = np.sqrt(np.square(v0[None, :, :] - a[:, None, :]).sum(-1)) * (1 + 1e-12)  # (N, N)
    big_a = kd + sk * rho[None, :]  # ||k_j(X) - kappa_i||
    big_b = qn + sq * rho  # ||q_i(X)||
    # logit moves: |dz'_ij| <= s (||W^Q|| rho_i ||k0_j - kappa_i|| + ||q_i|| ||W^K|| rho_j)
    delta = s * (sq * rho[:, None] * kd + big_b[:, None] * sk * rho[None, :])
    omega = np.exp(np.minimum(2 * delta.max(axis=1), 700.0)) * (1 + 1e-12)  # (N,)
    # p_ij(X) <= u_ij on the ball; 1e-15 covers the float64 rounding of p0 itself
    u = np.minimum(1.0, (p0 * (1 + 1e-12) + 1e-15 * (p0 > 0)) * omega[:, None])
    w_v = np.square(vd + sv * rho[None, :])
    sigma = np.sqrt(np.minimum((u * w_v).sum(axis=1), w_v.max(axis=1))) * (1 + 1e-12)
    a_t = np.sqrt(np.minimum((u * np.square(big_a)).sum(axis=1),
                             np.square(big_a).max(axis=1))) * (1 + 1e-12)
    colmax = float(u.sum(axis=0).max()) * (1 + 1e-12)
    mixed = float((np.square(sigma * big_b)[:, None] * u).sum(axis=0).max()) * (1 + 1e-12)
    jac = sv * math.sqrt(colmax) + s * (sq * float((sigma * a_t).max()) + sk * math.sqrt(mixed))
    reach = np.sqrt(np.minimum((u * np.square(rho)[None, :]).sum(axis=1), float(rho.max()) ** 2))
    dev = sv * reach + s * sigma * (sq * a_t * rho + big_b * sk * reach)
    return jac * (1 + 1e-12), dev * (1 + 1e-12)


def dp_probs_bound(layer: DPAttention, x: BallValue, p0: np.ndarray) -> tuple[float,
                                                                            np.ndarray]:
    """`||W^O|| sqrt(sum_h J_h^2)` with `J_h` around the centre's probabilities, and per-token
    output deviations `||W^O|| sqrt(sum_h dev_hi^2)`."""
    c = x.center.reshape(-1, x.center.shape[-1])  # (N, D)
    rho = x.rho.reshape(-1) * (1 + 1e-15)
    heads, _, d = layer.wq.shape
    s = inv_sqrt_up(d) if layer.scale is None else abs(float(layer.scale))
    bq = np.zeros((heads, d)) if layer.bq is None else np.asarray(
        layer.bq, dtype=np.float64).reshape(heads, -1)
    f = lambda w: np.asarray(w, dtype=np.float64)  # noqa: E731
    js, devs = [], []
    for h in range(heads):
        j, dev = _dp_head_at_center(f(layer.wq[h]), f(layer.wk[h]), f(layer.wv[h]), bq[h],
                                    p0[h], c, rho, s)
        js.append(j)
        devs.append(dev)
    wo = spectral_norm_upper(layer.wo)
    jac = mul_up(wo, sqrt_up(add_up(*(mul_up(j, j) for j in js))))
    dev_tok = wo * np.sqrt(np.square(np.stack(devs)).sum(axis=0)) * (1 + 1e-12)
    return jac, dev_tok.reshape(x.rho.shape)


BallRule = Callable[[Any, list[Any], Ball], list[BallValue | None]]
BALL_FAMILIES: dict[type[Layer], BallRule] = {}


def ball_family(*kinds: type[Layer]) -> Callable[[BallRule], BallRule]:
    def deco(fn: BallRule) -> BallRule:
        for k in kinds:
            BALL_FAMILIES[k] = fn
        return fn

    return deco


def _need(v: BallValue | None, layer: Layer) -> BallValue:
    if v is None:
        raise BallNotCertified(f"{layer.name}: its input has no local bound")
    return v


def _center(layer: Layer, ball: Ball) -> np.ndarray:
    return ball.env[layer.outputs[0]].detach().numpy().astype(np.float64)


def _report(ball: Ball, layer: Layer, kind: str, factor: float, rule: str,
            global_factor: float | None = None) -> None:
    ball.acc.report(LayerBound(layer.name, kind, factor, nodes=layer.nodes, rule=rule,
                               global_upper=global_factor))


@ball_family(Norm)
def _norm(layer: Norm, args: list[Any], ball: Ball) -> list[BallValue | None]:
    x = _need(args[0], layer)
    glob = (rmsnorm_bound if layer.rms else layernorm_bound)(layer.gamma, layer.eps, "2")
    per_token = np.minimum(norm_ball_factors(layer.gamma, layer.eps, x, layer.rms), glob)
    f = min(up(float(per_token.max())), glob)
    kind = "rmsnorm" if layer.rms else "layernorm"
    _report(ball, layer, kind, f, f"{kind} on the ball: max|gamma| / sqrt((||P x0_i|| - "
            "rho_i)^2 / D + eps)", glob)
    lip = mul_up(x.lip, f)
    # both ends of a move are gamma * u with ||u|| <= sqrt(D) (beta cancels): a token moves
    # at most 2 sqrt(D) max|gamma| whatever the input does
    dim = int(np.asarray(layer.gamma).size)
    span = 2.0 * math.sqrt(dim) * float(np.abs(np.asarray(layer.gamma, dtype=np.float64)).max())
    rho = np.minimum(per_token * x.rho, span * (1 + 1e-12)) * (1 + 1e-15)
    beta = 0.0 if layer.beta is None else linear_bound(layer.beta[None, :], "2")
    bound = add_up(mul_up(sqrt_up(dim), float(np.abs(np.asarray(layer.gamma)).max())), beta)
    return [settle(_center(layer, ball), lip, rho, ball, amplify=f, in_norms=x.token_norms(),
                   bound=bound)]


@ball_family(Activation)
def _activation(layer: Activation, args: list[Any], ball: Ball) -> list[BallValue | None]:
    x = _need(args[0], layer)
    f = LAYER_ACTIVATION_LIPSCHITZ[layer.act]
    _report(ball, layer, f"activation:{layer.act}", f, "global slope bound")
    bound = None if layer.act == "sigmoid" else mul_up(f, x.reach())
    return [settle(_center(layer, ball), mul_up(x.lip, f), x.rho * f, ball, bound=bound)]


@ball_family(Identity)
def _identity(layer: Identity, args: list[Any], ball: Ball) -> list[BallValue | None]:
    return [_need(args[0], layer)]


@ball_family(DPAttention)
def _dp(layer: DPAttention, args: list[Any], ball: Ball) -> list[BallValue | None]:
    x = _need(args[0], layer)
    glob, out_r = dp_mha_ball(layer.wq, layer.wk, layer.wv, layer.wo, layer.n, x.reach(), "2",
                              scale=layer.scale, bq=layer.bq, bv=layer.bv, bo=layer.bo,
                              bk=layer.bk, replaced=layer.replaced)
    rho: np.ndarray | float = math.inf
    if not layer.plain:
        # replaced logits / rotary: the centre-based rules below assume plain logits
        # q_i.k_j + additive constants; only the global ball bound is derived for these
        _report(ball, layer, "dp_mha_ball", glob, "global dot-product rule on the reachable "
                "tokens (masked_fill or rotary attention)", glob)
        return [settle(_center(layer, ball), mul_up(x.lip, glob), rho, ball, bound=out_r)]
    f = min(glob, dp_centred_bound(layer, x))
    p0 = ball.probs.get(layer.name)
    if p0 is not None and x.center.size == p0.shape[-1] * x.center.shape[-1]:
        with np.errstate(over="ignore", invalid="ignore"):
            fp, dev = dp_probs_bound(layer, x, p0)
        if math.isfinite(fp):  # (wide balls overflow it: then it is not used)
            f = min(f, fp)
        if np.all(np.isfinite(dev)):
            rho = dev
    _report(ball, layer, "dp_mha_ball", f, "dot-product attention around the centre "
            "(probabilities at X0 widened by the logits' moves)", glob)
    return [settle(_center(layer, ball), mul_up(x.lip, f), rho, ball, bound=out_r)]


@ball_family(L2Attention)
def _l2(layer: L2Attention, args: list[Any], ball: Ball) -> list[BallValue | None]:
    x = _need(args[0], layer)
    f = l2_mha_bound(layer.wq, layer.wv, layer.wo, layer.n, "2", layer.causal)
    _report(ball, layer, "l2_mha", f, "global L2 attention bound")
    return [settle(_center(layer, ball), mul_up(x.lip, f), math.inf, ball)]


def run_ball(graph: LayerGraph, x0: np.ndarray, eps: float, env: Any, acc: Verdicts,
             probs: dict[str, np.ndarray] | None = None) -> BallValue:
    """The output's value on the ball; raises BallNotCertified when a layer has no rule."""
    ball = Ball(float(eps), acc, env, probs or {})
    x = settle(np.asarray(x0, dtype=np.float64), 1.0, float(eps), ball)
    values: dict[str, BallValue | None] = {graph.input: x}
    for layer in graph.layers:
        rule = BALL_FAMILIES.get(type(layer))
        if rule is None:
            raise BallNotCertified(f"{layer.name}: no local rule for {type(layer).__name__}")
        outs = rule(layer, [values.get(i) for i in layer.inputs], ball)
        for name, v in zip(layer.outputs, outs, strict=False):
            values[name] = v
    out = values.get(graph.output)
    if out is None:
        raise BallNotCertified("the output's local bound is unknown")
    return out
