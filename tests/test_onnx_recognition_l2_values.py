"""L2 attention's value path read by what it computes (docs/bounds.md, "L2 attention read
from a graph: the value path"): `(X A) W^V`, one folded constant `A W^V`, the weights applied
to the queries first and `W^Q^T W^V` after them, `V(P X A)` on a 2-D input; an additive causal
mask read by value. Each certifies no more than Theorem 3.2 on the module's own weights and
never below a float64 Jacobian norm of the torch module; independent values stay refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lsa_models.onnx import analyse, load_onnx

from .onnx_l2_models import CdistHead, L2Attention
from .test_onnx_recognition import _export, _input, _jacobian_lower, _theorem

N, D = 6, 16
# A W^V folded by the exporter in float32: the bound may sit a float32 rounding above
# Theorem 3.2's on the float64 weights, never more
F32 = 1e-6


# (values, heads, rank, dynamo, causal, residual)
_SPELLINGS = [
    ("folded", 2, 3, False, False, False),
    ("folded", 2, 3, True, False, True),
    ("folded", 1, 2, False, True, False),
    ("queries_first", 2, 3, False, False, False),
    ("queries_first", 2, 3, True, True, False),
    ("queries_first", 2, 2, False, False, True),
]


@pytest.mark.parametrize("values,heads,rank,dynamo,causal,residual", _SPELLINGS)
def test_l2_value_path_in_any_association_order_certifies(
        tmp_path: Path, values: str, heads: int, rank: int, dynamo: bool, causal: bool,
        residual: bool) -> None:
    m = L2Attention(D, heads, "broadcast", causal=causal, residual=residual, seed=heads + rank,
                    values=values).eval()
    x = _input("broadcast", rank)
    model = load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo))
    for norm in ("2", "inf"):
        got = analyse(model, norm)  # type: ignore[arg-type]
        assert got.verdict == "certified", got.reason
        assert got.upper is not None and got.upper <= _theorem(m, norm) * (1 + F32)
        assert got.upper >= _jacobian_lower(m, x, norm)
    assert ("l2_mha_causal" if causal else "l2_mha") in [lb.kind for lb in got.layers]


@pytest.mark.parametrize("dynamo", [False, True])
def test_l2_independent_values_stay_refused(tmp_path: Path, dynamo: bool) -> None:
    m = L2Attention(D, 2, "broadcast", seed=3, values="independent").eval()
    got = analyse(load_onnx(_export(m, _input("broadcast", 3), tmp_path / "m.onnx", dynamo)),
                  "2")
    assert got.verdict == "not_certified"
    assert "span of the query projection" in (got.reason or ""), got.reason


@pytest.mark.parametrize("dynamo", [False, True])
def test_l2_additive_causal_mask_reads_as_causal(tmp_path: Path, dynamo: bool) -> None:
    # `logits + triu(full(-1e9), 1)`: the same weights as masking with -inf (exp underflows
    # to exactly 0), so the same certificate, with the reading named
    x = _input("broadcast", 3)
    added = L2Attention(D, 2, "broadcast", causal=True, seed=3, additive_mask=True).eval()
    inf = L2Attention(D, 2, "broadcast", causal=True, seed=3).eval()
    got = analyse(load_onnx(_export(added, x, tmp_path / "a.onnx", dynamo)), "2")
    want = analyse(load_onnx(_export(inf, x, tmp_path / "i.onnx", dynamo)), "2")
    assert got.verdict == "certified", got.reason
    assert got.upper == want.upper
    assert "l2_mha_causal" in [lb.kind for lb in got.layers]
    assert "read as causal masking" in got.method


def test_l2_additive_mask_that_is_not_causal_is_refused(tmp_path: Path) -> None:
    class Banded(L2Attention):
        def _mask(self, logits: torch.Tensor) -> torch.Tensor:
            n = logits.shape[-1]
            return logits + torch.triu(torch.full((n, n), -1e9), 2)  # one key ahead visible

    m = Banded(D, 2, "broadcast", seed=3).eval()
    got = analyse(load_onnx(_export(m, _input("broadcast", 3), tmp_path / "m.onnx", False)),
                  "2")
    assert got.verdict == "not_certified"
    assert "additive mask other than causal" in (got.reason or ""), got.reason


def test_l2_cdist_head_with_values_after_the_weights_on_a_2d_input(tmp_path: Path) -> None:
    m = CdistHead(D, 8, seed=1).eval()
    x = torch.randn(N, D)
    got = analyse(load_onnx(_export(m, x, tmp_path / "m.onnx", False)), "2")
    assert got.verdict == "certified", got.reason
    assert got.upper is not None and got.upper >= _jacobian_lower(m, x, "2")


# each example exports and analyses an ONNX graph (about a second): a fixed small count
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), heads=st.sampled_from([1, 2, 4]),
       values=st.sampled_from(["a_then_v", "folded", "queries_first"]),
       norm=st.sampled_from(["2", "inf"]), scale=st.floats(0.2, 3.0))
def test_l2_value_path_bound_never_below_exact_jacobians(
        tmp_path: Path, seed: int, heads: int, values: str, norm: str, scale: float) -> None:
    m = L2Attention(D, heads, "broadcast", seed=seed, values=values).eval()
    with torch.no_grad():
        m.wq.mul_(scale)  # sharper or flatter attention
    x = _input("broadcast", 3)
    got = analyse(load_onnx(_export(m, x, tmp_path / "m.onnx", False)), norm)  # type: ignore[arg-type]
    assert got.verdict == "certified", got.reason
    assert got.upper is not None and got.upper <= _theorem(m, norm) * (1 + F32)
    assert got.upper >= _jacobian_lower(m, x, norm, samples=4)


@pytest.mark.parametrize("eq,shapes", [
    ("bnd,hde->bhne", [(2, 5, 4), (3, 4, 6)]),  # heads by einsum
    ("tbe,hed->tbhd", [(5, 2, 4), (3, 4, 6)]),  # sequence first
    ("bnd,hdf,hfe->bhne", [(2, 5, 4), (3, 4, 4), (3, 4, 6)]),  # the paper's X A^h W^V,h
    ("bhnm,bhme->bnhe", [(2, 3, 5, 5), (2, 3, 5, 6)]),
])
def test_einsum_lowering_computes_the_same(eq: str, shapes: list[tuple[int, ...]]) -> None:
    import onnx

    from lsa_models.onnx.ops import OPS, Node, RunContext
    from lsa_models.onnx.rewrite import canonical_layouts

    gen = torch.Generator().manual_seed(0)
    names = [f"t{k}" for k in range(len(shapes))]
    env = {n: torch.randn(s, generator=gen, dtype=torch.float64)
           for n, s in zip(names, shapes, strict=True)}
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    lowered = canonical_layouts([Node("e", "Einsum", names, ["y"], {"equation": eq.encode()})],
                                model)
    assert "Einsum" not in [nd.op_type for nd in lowered if nd.outputs == ["y"]]
    env.update({t.name: torch.from_numpy(onnx.numpy_helper.to_array(t).copy())
                for t in model.graph.initializer})
    ctx = RunContext(torch.float64)
    for nd in lowered:
        (env[nd.outputs[0]],) = OPS[nd.op_type].run(nd, [env[i] for i in nd.inputs], ctx)
    want = torch.einsum(eq, *(env[n] for n in names))
    assert torch.allclose(env["y"], want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_l2_sequence_first_einsum_heads_certify(tmp_path: Path, dynamo: bool,
                                                causal: bool) -> None:
    # neural_stpp's layout: (T, B, D) input, einsum heads, (T, S, B, H) logits softmaxed
    # over S, causal by an added triu(full(-1e9), 1)[..., None, None]
    m = L2Attention(D, 2, "stpp", causal=causal, seed=5).eval()
    x = _input("stpp", 3)
    got = analyse(load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo)), "2")
    assert got.verdict == "certified", got.reason
    assert ("l2_mha_causal" if causal else "l2_mha") in [lb.kind for lb in got.layers]
    assert got.upper is not None and got.upper >= _jacobian_lower(m, x, "2")
