"""Property tests of the affine value forms (lsa_models/engine/affine/form.py): for an input
X = X0 + d with d in the ball, every linear functional w of an op's exact float64 output must
lie in the range the form gives it,
    w . (T(X) - T(X0)) in w . o +- (eps ||w^T a_in||_dual + ||w^T a_sym||_1 + |w| . b),
which is what the margins' lower bounds use. Points: the corners (or boundary points) that
maximise and minimise the functional's linear part, random corners and interior points."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.engine import elementwise_chains as fused
from lsa_models.engine.affine import elementwise as affine_elementwise
from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import linear as affine_linear
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.drivers.jacobian_walk import fused_chains
from lsa_models.engine.drivers.margins import margin_lower_bounds
from lsa_models.engine.values import Ball, box_to_two, dual_row_norms
from lsa_models.onnx import load_onnx
from lsa_models.onnx.ops import Node
from tests.margins import descend_margin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from local_models import KINDS, build, center, export  # noqa: E402

from tests.profile import at_most

P = 5


def _functional(f: Aff, w: np.ndarray, ball: Ball) -> tuple[float, float]:
    """The range of w . (T(X) - T(X0)) the form gives (w in the tensor's shape), plus the
    allowance for the centre's own margin, |w| . m."""
    k = f.c.size
    a = (w.reshape(k, 1) * f.a.reshape(k, -1)).sum(axis=0)
    p = ball.size
    lin = ball.eps * float(dual_row_norms(np.abs(a[:p])[None], ball.norm)[0]) + \
        float(np.abs(a[p:]).sum())
    o = float((w * f.o).sum())
    r = lin + float((np.abs(w) * (f.b + f.m)).sum())
    pad = 1e-11 * (abs(o) + r) + 1e-14
    return o - r - pad, o + r + pad


def _points(rng: np.random.Generator, ball: Ball, dirs: list[np.ndarray]) -> list[np.ndarray]:
    """The extreme points of the given linear parts, random corners and interior points."""
    out = []
    for g in dirs:
        for s in (1.0, -1.0):
            if ball.norm == "inf":
                out.append(s * ball.eps * np.sign(g))
            else:
                out.append(s * ball.eps * g / max(np.linalg.norm(g), 1e-300))
    for _ in range(6):
        if ball.norm == "inf":
            d = rng.choice([-1.0, 1.0], size=ball.size) * ball.eps if rng.random() < 0.5 \
                else rng.uniform(-ball.eps, ball.eps, size=ball.size)
        else:
            d = rng.standard_normal(ball.size)
            d *= ball.eps / np.linalg.norm(d) * (1.0 if rng.random() < 0.5 else rng.random())
        out.append(d)
    return out


def _check(fn: Callable[[torch.Tensor], torch.Tensor], f: Aff, ball: Ball,
           rng: np.random.Generator, n_w: int = 4) -> None:
    """fn maps the ball's d (P,) to the tensor; f is its form."""
    y0 = fn(torch.zeros(ball.size, dtype=torch.float64)).numpy()
    ws = [rng.standard_normal(f.shape) for _ in range(n_w)]
    ws += [np.eye(f.c.size)[i].reshape(f.shape) for i in rng.choice(f.c.size, 3)]
    for w in ws:
        k = f.c.size
        g = (w.reshape(k, 1) * f.a.reshape(k, -1)[:, :ball.size]).sum(axis=0)
        lo, hi = _functional(f, w, ball)
        for d in _points(rng, ball, [g]):
            y = fn(torch.from_numpy(d)).numpy()
            v = float((w * (y - y0)).sum())
            assert lo <= v <= hi, (lo, v, hi)


def _source(rng: np.random.Generator, shape: tuple[int, ...], ball: Ball, scale: float = 1.0
            ) -> tuple[Aff, Callable[[torch.Tensor], torch.Tensor]]:
    """A form with symbols: tanh(c + A d), and its exact function of d."""
    c = rng.standard_normal(shape) * scale
    a = rng.standard_normal((*shape, ball.size))
    x = Aff(c, np.zeros(shape), np.zeros(shape), a, np.zeros(shape))
    ch = fused.Chain("x", "y", [Node("t", "Tanh", ["x"], ["y"])])
    f = affine_rules.elementwise(x, affine_rules.chain_fn(ch, {}), ball, out_c=np.tanh(c),
                           out_m=np.zeros(shape))
    ct, at = torch.from_numpy(c), torch.from_numpy(a)
    return f, lambda d: torch.tanh(ct + at @ d)


@contextlib.contextmanager
def _symbols(ball: Ball) -> Iterator[None]:
    """A fresh symbol budget for the forms built inside (as a walk sets it)."""
    token = affine.SPACE.set([ball.size, 0])
    try:
        yield
    finally:
        affine.SPACE.reset(token)


EPS = st.sampled_from([1e-3, 1e-2, 1e-1, 0.5])
NORM = st.sampled_from(["2", "inf"])

_FNS: dict[str, tuple[affine_rules.Fn, Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "exp": (affine_rules.EXP, torch.exp, False),
    "square": (affine_rules.SQUARE, torch.square, False),
    "reciprocal": (affine_rules.RECIPROCAL, torch.reciprocal, True),
    "rsqrt": (affine_rules.RSQRT, torch.rsqrt, True),
    "sqrt": (affine_rules.SQRT, torch.sqrt, True),
    "relu": (affine_rules.RELU, torch.relu, False)}


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM, kind=st.sampled_from(sorted(_FNS)))
def test_affine_elementwise_encloses_every_functional(seed: int, eps: float, norm: str,
                                                      kind: str) -> None:
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        src, g = _source(rng, (2, 3), ball)
        fn, tfn, positive = _FNS[kind]
        if positive:  # 2 + tanh(...) > 0
            src = affine_linear._shift(src, np.asarray(2.0))
            g0 = g
            g = lambda d: 2.0 + g0(d)  # noqa: E731
        try:
            out = affine_rules.elementwise(src, fn, ball)
        except affine.NotAffine:  # the form's range reaches 0 (refused, not unsound)
            assert positive and eps >= 0.1
            return
        _check(lambda d: tfn(g(d)), out, ball, rng)


@settings(max_examples=at_most(200), deadline=None)  # an example costs ~60 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM)
def test_affine_relu_grad_encloses_every_functional(seed: int, eps: float, norm: str) -> None:
    """g H(x) (the tangent and adjoint of Relu, internal_ops.RELU_GRAD) for forms g, x whose
    ranges cross 0 at the larger balls: every functional at the extreme points stays within
    the form's range, the step taken at the true x."""
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        g, gf = _source(rng, (2, 3), ball)
        x, xf = _source(rng, (2, 3), ball, scale=0.3)
        z = torch.zeros(P, dtype=torch.float64)
        c0 = (gf(z) * (xf(z) > 0)).numpy()
        out = affine_rules._relu_grad([g, x], ball, None, c0, np.zeros_like(c0))
        _check(lambda d: gf(d) * (xf(d) > 0).to(torch.float64), out, ball, rng)


@settings(max_examples=at_most(300), deadline=None)  # an example costs ~50 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM,
       kind=st.sampled_from(["mul", "broadcast", "matmul", "square"]))
def test_affine_product_encloses_every_functional(seed: int, eps: float, norm: str,
                                                  kind: str) -> None:
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        out, fn = product_case(rng, ball, kind)
        _check(fn, out, ball, rng)


def product_case(rng: np.random.Generator, ball: Ball, kind: str
                 ) -> tuple[Aff, Callable[[torch.Tensor], torch.Tensor]]:
    """The product of two tanh forms (`kind`: mul, broadcast, matmul, square) and its exact
    function of d."""
    x, fx = _source(rng, (3, 4), ball, 2.0)
    shape = {"mul": (3, 4), "broadcast": (3, 1), "matmul": (4, 2), "square": (3, 4)}[kind]
    y, fy = (x, fx) if kind == "square" else _source(rng, shape, ball, 2.0)
    matmul = kind == "matmul"
    out = affine_rules.product(x, y, ball, matmul)
    return out, (lambda d: fx(d) @ fy(d)) if matmul else (lambda d: fx(d) * fy(d))


@settings(max_examples=at_most(300), deadline=None)  # an example costs ~70 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM, scale=st.sampled_from([0.3, 3.0]))
def test_affine_softmax_then_matmul_encloses_every_functional(seed: int, eps: float,
                                                              norm: str, scale: float) -> None:
    """Softmax (through its exp / sum / reciprocal chain, narrowed to the probability
    ranges) and the product of its rows with a value matrix (the rows' changes sum to 0)."""
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        softmax_then_matmul(rng, ball, scale, _check)


Check = Callable[[Callable[[torch.Tensor], torch.Tensor], Aff, Ball, np.random.Generator],
                 None]


def softmax_then_matmul(rng: np.random.Generator, ball: Ball, scale: float,
                        check: Check) -> None:
    """Softmax of tanh logits, then its product with a value matrix, each checked."""
    z, fz = _source(rng, (2, 4), ball)
    wz = rng.standard_normal((2, 4)) * scale  # logits = wz * tanh(...) * 3
    logits = affine_linear._scale_const(z, 3 * wz, 3 * wz * z.c, np.zeros((2, 4)), ball)
    pc = torch.softmax(torch.from_numpy(logits.c), -1).numpy()
    try:
        p = affine_rules.softmax(logits, -1, pc, ball, None, None)
    except affine.NotAffine:  # wide logits at eps 0.5: the graph step takes the interval
        assert ball.eps >= 0.1
        return
    assert p.stochastic
    tw = torch.from_numpy(3 * wz)
    check(lambda d: torch.softmax(tw * fz(d), -1), p, ball, rng)
    v, fv = _source(rng, (4, 3), ball, 2.0)
    out = affine_rules.product(p, v, ball, True)
    check(lambda d: torch.softmax(tw * fz(d), -1) @ fv(d), out, ball, rng)


@settings(max_examples=at_most(300), deadline=None)  # an example costs ~40 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM,
       scale=st.sampled_from([0.01, 0.3, 3.0]), ln_eps=st.sampled_from([1e-5, 1e-2]))
def test_affine_layernorm_encloses_every_functional(seed: int, eps: float, norm: str,
                                                    scale: float, ln_eps: float) -> None:
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        layernorm_case(rng, ball, scale, ln_eps, _check)


def layernorm_case(rng: np.random.Generator, ball: Ball, scale: float, ln_eps: float,
                   check: Check) -> None:
    """LayerNorm of scaled tanh values, checked."""
    x, fx = _source(rng, (2, 6), ball, 1.0)
    x = affine_linear._scale_const(x, np.asarray(scale), scale * x.c, np.zeros((2, 6)), ball)
    gam, beta = rng.standard_normal(6), rng.standard_normal(6)
    tl = torch.nn.functional.layer_norm
    tg, tb = torch.from_numpy(gam), torch.from_numpy(beta)
    yc = tl(torch.from_numpy(x.c), (6,), tg, tb, ln_eps).numpy()
    out = affine_rules.layernorm(x, gam, beta, ln_eps, yc, ball)
    check(lambda d: tl(scale * fx(d), (6,), tg, tb, ln_eps), out, ball, rng)


def test_affine_symbols_past_the_budget_go_to_the_box() -> None:
    """Past MAX_SYMBOLS a new error is a box term: the range is the same, sound either way."""
    ball = Ball(np.zeros(P), 0.1, "inf")
    rng = np.random.default_rng(0)
    token = affine.SPACE.set([P, affine.MAX_SYMBOLS])
    try:
        src, g = _source(rng, (2, 3), ball)
        assert src.a.shape[-1] == P and np.all(src.b > 0)
        _check(g, src, ball, rng)
    finally:
        affine.SPACE.reset(token)


def _model(kind: str, tmp: Path):  # type: ignore[no-untyped-def]
    return load_onnx(export(build(kind), tmp / f"{kind}.onnx").read_bytes())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["inf", "2"])
def test_affine_walk_encloses_every_tensor_of_the_issue_classifiers(
        kind: str, norm: str, tmp_path: Path) -> None:
    """Every tensor's range over the ball holds at the extreme points of its entries' and
    of random functionals' linear parts (eps where the Transformers' forms are wide)."""
    om = _model(kind, tmp_path)
    x0 = center().numpy().astype(np.float64)
    module = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x0))
    chains, inside = fused_chains(om, module, env)
    rng = np.random.default_rng(1)
    for eps in ((0.03, 0.3) if norm == "inf" else (0.1, 1.0)):
        ball = Ball(x0, eps, norm)
        forms = affine_rules.walk(list(module.runtime_nodes), om.spec.input_name, env, ball, chains,
                            inside)
        assert om.spec.output_name in forms
        names = [n for n in forms if n != om.spec.input_name]
        for name in rng.choice(names, 6, replace=False):
            f = forms[name]

            def run(d: torch.Tensor, name: str = name) -> torch.Tensor:
                with torch.no_grad():
                    return module.run_env(torch.from_numpy(x0) + d.reshape(x0.shape))[name]
            _check(run, f, ball, rng, n_w=2)


@pytest.mark.parametrize("kind", KINDS)
def test_affine_margin_lower_bounds_hold_against_pgd(kind: str, tmp_path: Path) -> None:
    """PGD on each margin inside the ball never goes below its lower bound."""
    om = _model(kind, tmp_path)
    x0 = center().numpy().astype(np.float64)
    f = om.module.with_dtype(torch.float64)
    logits = f(torch.from_numpy(x0)).reshape(-1)
    label = int(logits.argmax())
    for norm, eps in (("inf", 0.03), ("2", 0.2)):
        low = margin_lower_bounds(om, x0, eps, norm, label)
        assert low is not None and set(low) == set(range(logits.numel())) - {label}
        gen = torch.Generator().manual_seed(0)
        for j, bound in low.items():
            d = (torch.rand(x0.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
            for m in descend_margin(f, torch.from_numpy(x0), label, j, eps, norm, d):
                assert m >= bound - 1e-12


@settings(max_examples=at_most(300), deadline=None)  # an example costs ~70 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM, matmul=st.booleans())
def test_affine_product_of_exact_forms_holds_at_every_corner(seed: int, eps: float, norm: str,
                                                             matmul: bool) -> None:
    """x = cx + Ax d, y = cy + Ay d exactly (no symbols): the product's change is linear plus
    the quadratic d^T M d, which attains its extremes at the inf-ball's corners (all 2^P
    enumerated) or, on the 2-ball, along the extreme eigenvectors (sampled densely)."""
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        sx, sy = (3, 4), ((4, 2) if matmul else (3, 4))
        cx, cy = rng.standard_normal(sx), rng.standard_normal(sy)
        ax, ay = rng.standard_normal((*sx, P)), rng.standard_normal((*sy, P))
        if rng.random() < 0.5:  # correlated operands: cancellation in sum_j
            ay = (np.swapaxes(ax, 0, 1)[:, :2] if matmul else ax) + 0.1 * ay
        x = Aff(cx, np.zeros(sx), np.zeros(sx), ax, np.zeros(sx))
        y = Aff(cy, np.zeros(sy), np.zeros(sy), ay, np.zeros(sy))
        out = affine_rules.product(x, y, ball, matmul)
        op = np.matmul if matmul else np.multiply
        y0 = op(cx, cy)
        if norm == "inf":
            corners = np.array(np.meshgrid(*[[-eps, eps]] * P)).reshape(P, -1).T
        else:
            g = rng.standard_normal((400, P))
            corners = eps * g / np.linalg.norm(g, axis=1, keepdims=True)
        ws = [rng.standard_normal(out.shape)] + \
            [np.eye(out.c.size)[i].reshape(out.shape) for i in range(out.c.size)]
        for w in ws:
            lo, hi = _functional(out, w, ball)
            for d in corners:
                v = float((w * (op(cx + ax @ d, cy + ay @ d) - y0)).sum())
                assert lo <= v <= hi, (lo, v, hi)


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), d=st.integers(1, 4), q=st.integers(1, 9),
       spread=st.sampled_from([0.01, 1.0, 100.0]))
def test_affine_box_to_two_is_above_every_corner(seed: int, d: int, q: int,
                                                 spread: float) -> None:
    """sup ||a e||_2 over the box is attained at a corner: every corner stays below the
    bound (columns of very different sizes included)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((2, d, q)) * spread ** rng.uniform(-1, 1, q)
    bound = box_to_two(a)
    corners = np.array(np.meshgrid(*[[-1.0, 1.0]] * q)).reshape(q, -1)  # (Q, 2^Q)
    best = np.linalg.norm(a @ corners, axis=-2).max(axis=-1)  # (2,)
    assert np.all(best <= bound * (1 + 1e-12)), (best, bound)


@settings(max_examples=at_most(200), deadline=None)  # an example costs ~40 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=EPS, norm=NORM)
def test_affine_token_radius_holds_on_the_ball(seed: int, eps: float, norm: str) -> None:
    """||T_t(X) - T_t(X0)||_2 per token within token_radius at the tokens' worst directions
    of the linear part (the top singular vectors; their signs on the inf-ball), every corner
    (inf) and random points."""
    rng = np.random.default_rng(seed)
    ball = Ball(np.zeros(P), eps, norm)
    with _symbols(ball):
        x, fx = _source(rng, (3, 4), ball, 2.0)
        y, fy = _source(rng, (3, 4), ball, 2.0)
        out = affine_rules.product(x, y, ball, False)
        rad = affine.token_radius(out, ball)[..., 0]
        y0 = (fx(torch.zeros(P, dtype=torch.float64)) * fy(torch.zeros(P, dtype=torch.float64)))
        dirs = [np.linalg.svd(out.a[t, :, :P])[2][0] for t in range(3)]
        pts = _points(rng, ball, dirs)
        if norm == "inf":
            pts += list(eps * np.array(np.meshgrid(*[[-1.0, 1.0]] * P)).reshape(P, -1).T)
        for d in pts:
            dt = torch.from_numpy(d)
            dev = np.linalg.norm((fx(dt) * fy(dt) - y0).numpy(), axis=-1)
            assert np.all(dev <= rad), (dev, rad)


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), which=st.sampled_from(["exp", "rsqrt", "reciprocal",
                                                         "square", "relu"]))
def test_chord_candidate_encloses_the_convex_remainder(seed: int, which: str) -> None:
    """affine_elementwise._chord: for f convex on [lo, hi] and the true centre t0 in
    [tlo, thi], f(t) - f(t0) - lam (t - t0) lies in shift +- err at dense points t and t0
    (the grid of tangent lines is coarser than this check); 0.3x of err fails it."""
    rng = np.random.default_rng(seed)
    fn, f = {"exp": (affine_rules.EXP, np.exp),
             "rsqrt": (affine_rules.RSQRT, lambda t: 1 / np.sqrt(t)),
             "reciprocal": (affine_rules.RECIPROCAL, lambda t: 1 / t),
             "square": (affine_rules.SQUARE, np.square),
             "relu": (affine_rules.RELU, lambda t: np.maximum(t, 0.0))}[which]
    lo = rng.uniform(0.05, 2.0, 6) if which in ("rsqrt", "reciprocal") else \
        rng.uniform(-3.0, 2.0, 6)
    hi = lo + rng.uniform(1e-3, 3.0, 6)
    tc = lo + (hi - lo) * rng.uniform(0.2, 0.8, 6)
    tlo, thi = tc - 1e-9 * np.abs(tc), tc + 1e-9 * np.abs(tc)
    lam, shift, err = affine_elementwise._chord(fn, lo, hi, tlo, thi, np.ones(6, dtype=bool))
    assert np.all(np.isfinite(err))
    t = lo[:, None] + (hi - lo)[:, None] * np.linspace(0, 1, 2001)  # (6, 2001)
    for t0 in (tlo, thi, tc):
        r = f(t) - f(t0)[:, None] - lam[:, None] * (t - t0[:, None])
        assert np.all(np.abs(r - shift[:, None]) <= err[:, None] * (1 + 1e-9) + 1e-12)


MASKED = ("torch-mha-boolmask", "sdpa-causal[", "hf-llama", "xt-decoder",
          "l2-broadcast-1head-causal", "torch-decoder-prenorm", "sdpa-mask")


@pytest.mark.parametrize("key", MASKED)
@pytest.mark.parametrize("norm", ["inf", "2"])
def test_affine_walk_through_attention_masks_encloses_every_tensor(key: str, norm: str,
                                                                   tmp_path: Path) -> None:
    """Masked attention from other libraries (torch's bool and causal masks, SDPA, HF
    LLaMA's float-minimum mask, x-transformers' Where, a hand-written L2 causal mask): the
    walk reaches the output (before: it stopped at the mask's Add or Where), and every
    tensor's range holds at the extreme points (the masked scores themselves excepted: their
    entries are placeholders only a Softmax reads)."""
    import warnings

    from tests.zoo.cases import CASES
    from tests.zoo.harness import export as zoo_export
    warnings.simplefilter("ignore")
    case = next(c for c in CASES if c.key.startswith(key) and "(N, D)" not in c.key
                and c.layout in ("(1, N, D)", "inputs_embeds"))
    built = case.build()
    path = zoo_export(built, case.exporters[0], tmp_path / "m.onnx")
    om = load_onnx(path.read_bytes(), path.name)
    x0 = built.example.numpy().astype(np.float64)
    module = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x0))
    chains, inside = fused_chains(om, module, env)
    rng = np.random.default_rng(2)
    ball = Ball(x0, 1e-2 if norm == "inf" else 5e-2, norm)
    forms = affine_rules.walk(list(module.runtime_nodes), om.spec.input_name, env, ball,
                              chains, inside)
    assert om.spec.output_name in forms
    assert any(f.masked is not None for f in forms.values())
    names = [n for n, f in forms.items() if n != om.spec.input_name and f.masked is None]
    soft = [n for n in names if "Softmax" in n]
    for name in list(rng.choice(names, 4, replace=False)) + soft[:2]:
        f = forms[name]

        def run(d: torch.Tensor, name: str = name) -> torch.Tensor:
            with torch.no_grad():
                return module.run_env(torch.from_numpy(x0) + d.reshape(x0.shape))[name]
        _check(run, f, ball, rng, n_w=2)


def test_split_lin_memo_matches_a_fresh_computation_and_is_read_only() -> None:
    """split_lin's memo (keyed by the coefficient array's identity, held weakly) gives what a
    fresh computation gives, for the same form, a form over new arrays of the same shape (ids
    reused after a release) and another ball; its arrays cannot be written."""
    rng = np.random.default_rng(3)
    ball = Ball(np.zeros((2, 3)), 0.1, "inf")

    def form() -> Aff:
        a = rng.standard_normal((2, 3, 6 + 5))
        z = np.zeros((2, 3))
        return Aff(z, z, z, a, z)
    for _ in range(40):  # new arrays, many at freed addresses
        x = form()
        for b in (ball, Ball(np.zeros((2, 3)), 0.2, "2")):
            li, ls = affine.split_lin(x, b)
            li0, ls0 = affine._split_lin(x, b)
            assert np.array_equal(li, li0) and np.array_equal(ls, ls0)
            assert affine.split_lin(x, b)[0] is li  # the memo's hit
        with pytest.raises(ValueError):
            li[0, 0] = 1.0
        del x


def test_split_lin_memo_under_threads_gives_each_form_its_own_sizes() -> None:
    """The service walks in several threads at once: split_lin from 4 threads over forms
    made and dropped concurrently gives every one what a fresh computation gives, and no
    thread fails on the shared memo."""
    from concurrent.futures import ThreadPoolExecutor
    ball = Ball(np.zeros((2, 3)), 0.1, "2")

    def work(seed: int) -> bool:
        rng = np.random.default_rng(seed)
        for _ in range(200):
            z = np.zeros((2, 3))
            x = Aff(z, z, z, rng.standard_normal((2, 3, 9)), z)
            li, ls = affine.split_lin(x, ball)
            li0, ls0 = affine._split_lin(x, ball)
            if not (np.array_equal(li, li0) and np.array_equal(ls, ls0)):
                return False
        return True
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 40), cols=st.integers(1, 300),
       block=st.sampled_from([1, 7, 64, 1 << 18]))
def test_abs_sum_in_blocks_gives_the_plain_sums(seed: int, rows: int, cols: int,
                                                block: int) -> None:
    """`affine.abs_sum` (blocks of rows through one buffer) gives exactly the numbers of
    np.abs(a[..., lo:hi]).sum(axis=-1), for any block size and column range."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, 2, cols)) * (rng.random((rows, 2, cols)) < 0.7)
    lo = int(rng.integers(0, cols))
    hi = int(rng.integers(lo, cols + 5))
    saved = affine.ABS_SUM_BLOCK
    affine.ABS_SUM_BLOCK = block
    try:
        got = affine.abs_sum(a, lo, hi)
    finally:
        affine.ABS_SUM_BLOCK = saved
    assert np.array_equal(got, np.abs(a[..., lo:hi]).sum(axis=-1))


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), lead=st.sampled_from([(), (3,), (2, 3)]),
       k=st.integers(1, 5), m=st.integers(1, 5), p=st.integers(1, 7),
       side=st.sampled_from([0, 1]))
def test_matmul_tangents_match_the_vmapped_op(seed: int, lead: tuple[int, ...], k: int,
                                              m: int, p: int, side: int) -> None:
    """`rules.run_tangents` of a MatMul by a constant matrix (the direct BLAS product) gives
    the op vmapped over the tangents' last axis (X W and C X, vectors and batches)."""
    from lsa_models.engine.enclosure import rules
    rng = np.random.default_rng(seed)
    nd = Node("mm", "MatMul", ["a", "b"], ["y"], {}, "")
    shape = (*lead, k)  # X (..., k) for X W; for C X, X (..., k, m) with C (m, k)
    w = torch.from_numpy(rng.standard_normal((k, m) if side == 0 else (m, k)))
    xshape = shape if side == 0 else (*shape, m)
    x = rng.standard_normal((*xshape, p))
    fixed: list[torch.Tensor | None] = [None, w] if side == 0 else [w, None]
    fast = rules._matmul_tangents(nd, fixed, [side], [x])
    assert fast is not None

    def f(t: torch.Tensor) -> torch.Tensor:
        ins = list(fixed)
        ins[side] = t
        return rules.OPS["MatMul"].run(nd, ins, rules.CTX)[0]
    ref = torch.func.vmap(f, in_dims=-1, out_dims=-1)(torch.from_numpy(x)).numpy()
    assert fast.shape == ref.shape
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-12 * float(np.abs(ref).max() + 1))
