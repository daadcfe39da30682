"""The bound engine (lsa_models/bounds/layer_graph): its accumulator, composition and the two
front ends' lowering, plus a soundness hunt over random native compositions."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models import L2MHA, DotProductMHA, Transformer, TransformerConfig, certify
from lsa_models.bounds import Analyzer
from lsa_models.bounds.formulas import layernorm_bound, linear_bound
from lsa_models.bounds.layer_graph import (
    CertifiedResidual,
    Context,
    L2Attention,
    Layer,
    LayerGraph,
    Linear,
    Norm,
    Refused,
    Residual,
    Series,
    Value,
    Verdicts,
    run,
)
from lsa_models.bounds.numerics import add_up, mul_up
from lsa_models.bounds.report import NormName
from tests.engine_golden import tighter_by_rounding
from tests.jacobians import jacobian_norm
from tests.profile import at_most


def _ctx(norm: NormName = "2", bounded: bool = False) -> Context:
    return Context(norm, "fold", Verdicts(), bounded)


def test_verdicts_not_lipschitz_outranks_an_earlier_not_certified() -> None:
    acc = Verdicts()
    acc.fail("not_certified", "first")
    acc.fail("not_lipschitz", "second")
    acc.fail("not_lipschitz", "third")
    assert acc.status() == "not_lipschitz" and acc.reason() == "second"
    assert acc.status(since=3) == "certified" and acc.reason(since=3) is None
    assert acc.reason(since=2) == "third"


def test_series_folds_its_parts_into_mul_up_of_their_constants() -> None:
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(5, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    layer = Series("s", [Linear(f"l{i}", w) for i, w in enumerate(ws)])
    ctx = _ctx()
    v = ctx.local(layer, Value(1.0, None))
    assert v is not None
    assert v.lip == mul_up(*(linear_bound(w, "2") for w in ws))  # exact, not approximate
    assert [lb.name for lb in ctx.acc.layers] == ["l0", "l1", "l2"]


def test_residual_adds_one_to_its_branch_and_adds_the_radii() -> None:
    w = torch.eye(3, dtype=torch.float64) * 2.0
    ctx = _ctx()
    v = ctx.local(Residual("r", Linear("l", w)), Value(1.0, 0.5))
    assert v is not None
    assert v.lip == add_up(1.0, linear_bound(w, "2"))
    branch_radius = add_up(mul_up(linear_bound(w, "2"), 0.5), 0.0)  # ||W|| r + ||b||, b = 0
    assert v.radius is not None and v.radius == add_up(0.5, branch_radius)


def test_a_failed_part_fails_the_series_and_later_parts_are_still_reported() -> None:
    gamma = torch.ones(4, dtype=torch.float64)
    layer = Series("s", [Refused("bad", "attention", "not_certified", "no theorem"),
                         Norm("ln", gamma, None, 1e-5)], block=True)
    ctx = _ctx()
    v = ctx.local(layer, Value(1.0, None))
    assert v is not None and math.isinf(v.lip)
    assert v.radius is not None  # a block passes on its last part's (LayerNorm's) radius
    kinds = [(lb.kind, lb.status) for lb in ctx.acc.layers]
    assert kinds == [("attention", "not_certified"), ("layernorm", "certified"),
                     ("block", "not_certified")]
    assert ctx.acc.layers[1].upper == layernorm_bound(gamma, 1e-5, "2")


def test_run_walks_a_graph_by_value_names_with_the_mul_up_chain() -> None:
    w = torch.full((2, 2), 0.5, dtype=torch.float64)
    graph = LayerGraph([Linear("a", w, inputs=["x"], outputs=["h"]),
                        Linear("b", w, inputs=["h"], outputs=["y"])], "x", "y", "mul_up")
    ctx = Context("2", "mul_up", Verdicts(), False)
    values = run(graph, ctx, Value(1.0, None))
    f = linear_bound(w, "2")
    y = values["y"]
    assert y is not None and y.lip == mul_up(mul_up(1.0, f), f)


def test_native_lowering_gives_typed_layers() -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16))
    root = Analyzer("2").lower(model, "", 5)
    assert isinstance(root, Series) and len(root.body) == 2
    block = root.body[0]
    assert isinstance(block, Series) and block.block
    first = block.body[0]
    assert isinstance(first, Residual) and isinstance(first.branch, Series)
    ln1, attn = first.branch.body
    assert isinstance(ln1, Norm) and isinstance(attn, L2Attention) and attn.n == 5


def test_dot_product_attention_whose_radius_is_lost_is_not_certified() -> None:
    # L2 attention does not bound its output's token norms: the dot-product layer after it
    # sees no radius. With an input radius the model is Lipschitz on that domain (not proven
    # otherwise): "not_certified"; without one, Theorem 3.1 applies: "not_lipschitz".
    torch.manual_seed(0)
    model = nn.Sequential(L2MHA(8, 2), DotProductMHA(8, 2))
    bounded = certify(model, "2", 4, 1.0)
    assert bounded.verdict == "not_certified"
    assert bounded.reason is not None and "does not reach it" in bounded.reason
    assert certify(model, "2", 4).verdict == "not_lipschitz"


def test_post_norm_block_passes_its_radius_on_after_a_refused_attention() -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16,
                                          attention="dp", norm_first=False))
    res = certify(model, "2", 4)
    attn = {lb.name: lb for lb in res.layers if lb.name.endswith("attn")}
    assert attn["blocks.0.attn"].status == "not_lipschitz"
    assert attn["blocks.1.attn"].kind == "dp_mha_radius" and attn["blocks.1.attn"].upper


def _leaves(layer: Layer) -> list[Layer]:
    if isinstance(layer, Series):
        return [leaf for part in layer.body for leaf in _leaves(part)]
    if isinstance(layer, Residual):
        return _leaves(layer.branch)
    return [layer]


@pytest.mark.parametrize("attention", ["dp", "l2", "l2_untied", "contractive_l2"])
def test_lowering_bounds_every_native_lm_with_engine_families(attention: str) -> None:
    from lsa_models.lm import CharTransformerLM, LMConfig

    torch.manual_seed(0)
    lm = CharTransformerLM(LMConfig(vocab_size=7, d_model=8, n_heads=2, n_layers=2, d_ff=16,
                                    seq_len=6, attention=attention))  # type: ignore[arg-type]
    root = Analyzer("2").lower(lm.continuous_part().eval(), "", 6)
    leaves = _leaves(root)
    assert [leaf.name for leaf in leaves[-2:]] == ["ln_f", "head"]
    blocks = [leaf for leaf in leaves if isinstance(leaf, CertifiedResidual)]
    assert len(blocks) == (4 if attention == "contractive_l2" else 0)


def test_certified_residual_is_one_plus_the_blocks_branch_bound_and_2_norm_only() -> None:
    from lsa_models.invertible import ContractiveTrunk, ContractiveTrunkConfig

    torch.manual_seed(1)
    trunk = ContractiveTrunk(ContractiveTrunkConfig(d_model=4, n_heads=2, n_layers=1, d_ff=8,
                                                    max_len=5, c=0.7)).eval()
    res = certify(trunk, "2", 9)  # N > max_len: the blocks recompute their bound for N
    consts = [add_up(1.0, b.lipschitz_upper(9)) for b in trunk.blocks]
    assert res.verdict == "certified" and res.upper == mul_up(*consts)
    assert [(lb.kind, lb.upper) for lb in res.layers] == list(zip(
        ["contractive_l2_block", "contractive_ffn_block"], consts, strict=True))
    refused = certify(trunk, "inf", 9)
    assert refused.verdict == "not_certified" and refused.upper is None
    assert refused.reason is not None and "blocks.0" in refused.reason
    assert [lb.status for lb in refused.layers] == ["not_certified"] * 2


@settings(max_examples=at_most(10), deadline=None)  # an example costs ~90 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), n=st.integers(1, 4), c=st.floats(0.1, 0.99),
       scale=st.floats(1e-2, 5.0), act=st.sampled_from(["relu", "gelu", "tanh"]))
def test_contractive_lm_bound_dominates_float64_jacobians(seed: int, n: int, c: float,
                                                          scale: float, act: str) -> None:
    from lsa_models.lm import CharTransformerLM, LMConfig

    torch.manual_seed(seed)
    lm = CharTransformerLM(LMConfig(vocab_size=5, d_model=4, n_heads=2, n_layers=2, d_ff=8,
                                    seq_len=4, c=c, activation=act))  # type: ignore[arg-type]
    part = lm.continuous_part().eval()
    res = certify(part, "2", n)
    assert res.verdict == "certified" and res.upper is not None
    f64 = copy.deepcopy(part).double()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x = scale * torch.randn(n, 4, generator=gen, dtype=torch.float64)
        assert jacobian_norm(lambda h: f64(h[None])[0], x, "2") <= res.upper


def test_tighter_by_rounding_accepts_only_ulp_decreases() -> None:
    old = {"verdict": "certified", "upper": (1.5).hex(), "layers": []}
    assert tighter_by_rounding(old, {**old, "upper": math.nextafter(1.5, 0).hex()})
    assert not tighter_by_rounding(old, {**old, "upper": math.nextafter(1.5, 2).hex()})
    assert not tighter_by_rounding(old, {**old, "upper": (1.4).hex()})
    assert not tighter_by_rounding(old, {**old, "verdict": "not_certified"})


_PARTS = st.lists(st.sampled_from(["linear", "tanh", "relu", "layernorm", "gelu-mlp"]),
                  min_size=1, max_size=4)


def _build(parts: list[str], d: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for p in parts:
        if p == "linear":
            mods.append(nn.Linear(d, d))
        elif p == "tanh":
            mods.append(nn.Tanh())
        elif p == "relu":
            mods.append(nn.ReLU())
        elif p == "layernorm":
            ln = nn.LayerNorm(d, eps=0.05)
            with torch.no_grad():
                ln.weight.uniform_(-2, 2)
            mods.append(ln)
        else:
            mods.append(nn.Sequential(nn.Linear(d, d), nn.GELU()))
    return nn.Sequential(*mods)


@settings(deadline=None)
@given(parts=_PARTS, d=st.integers(2, 5), n=st.integers(1, 3), seed=st.integers(0, 10**6),
       norm=st.sampled_from(["2", "inf"]), scale=st.floats(1e-3, 3.0))
def test_engine_bound_dominates_float64_jacobians(parts: list[str], d: int, n: int,
                                                  seed: int, norm: NormName,
                                                  scale: float) -> None:
    model = _build(parts, d, seed)
    res = certify(model, norm, n)
    assert res.verdict == "certified" and res.upper is not None
    f64 = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = scale * torch.randn(n, d, generator=gen, dtype=torch.float64)
        assert jacobian_norm(f64, x, norm) <= res.upper


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_onnx_front_end_bounds_a_native_export_with_the_same_families(tmp_path: Path,
                                                                      norm: NormName) -> None:
    from lsa_models.onnx import analyse, export_onnx, load_onnx

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16))
    path = export_onnx(model, tmp_path / "m.onnx", 4, dynamo=False)
    got = analyse(load_onnx(path.read_bytes()), norm)
    native = certify(model, norm, 4)
    # the graph's weights are read back from a float32 evaluation: equal to ~1e-9
    attn = [lb.upper for lb in got.layers if lb.kind == "l2_mha"]
    want = [lb.upper for lb in native.layers if lb.kind == "l2_mha"]
    assert len(attn) == len(want) == 1
    assert attn[0] is not None and want[0] is not None
    assert np.isclose(attn[0], want[0], rtol=1e-9)
    assert got.upper is not None and native.upper is not None
    assert np.isclose(got.upper, native.upper, rtol=1e-9)
