"""HF transformers models through both exporters (issue 12): built from configs with random
weights (nothing downloads); skipped when transformers is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lsa_models.onnx import analyse, load_onnx

from .jacobians import jacobian_norm
from .test_onnx_recognition import _export

transformers = pytest.importorskip("transformers")

N, D = 6, 16


class _Embeds(nn.Module):
    """`inputs_embeds` in, last hidden state out; an explicit all-ones attention mask keeps
    transformers off its packed-sequence detection (`torch.diff`, which TorchScript cannot
    export)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N, D)
        mask = torch.ones(x.shape[:2], dtype=torch.long)  # (B, N)
        return self.model(inputs_embeds=x, attention_mask=mask).last_hidden_state


def _gpt2(layers: int = 1) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=D, n_layer=layers, n_head=2, n_positions=16,
                                  vocab_size=50, bos_token_id=0, eos_token_id=0,
                                  use_cache=False, attn_implementation="eager")
    return _Embeds(transformers.GPT2Model(cfg)).eval()


def _ball_lower(m: nn.Module, radius: float, norm: str) -> float:
    """float64 Jacobian norms at random inputs whose tokens have 2-norm `radius`."""
    md = m.double()
    gen = torch.Generator().manual_seed(1)
    best = 0.0
    for _ in range(2):
        x = torch.randn(1, N, D, generator=gen, dtype=torch.float64)
        x = radius * x / x.norm(dim=-1, keepdim=True)  # (1, N, D)
        best = max(best, jacobian_norm(md, x, norm))
    m.float()
    return best


def test_onnx_recognition_gpt2_inputs_embeds_both_exporters_agree(tmp_path: Path) -> None:
    # TorchScript writes a float -> float Cast between the Softmax and P @ V and a Flatten
    # with axis = rank; both are read, and the bound equals the dynamo export's
    m = _gpt2()
    x = torch.randn(1, N, D)
    uppers = []
    for dynamo in (False, True):
        model = load_onnx(_export(m, x, tmp_path / f"g{int(dynamo)}.onnx", dynamo))
        got = analyse(model, "2", radius=1.0)
        assert got.verdict == "certified", (dynamo, got.reason)
        assert any(lb.kind == "dp_mha_radius" for lb in got.layers)
        uppers.append(got.upper)
        # pre-norm: the LayerNorm in front bounds the attention input, no radius needed
        assert analyse(model, "2").verdict == "certified"
    assert uppers[0] is not None and uppers[1] is not None
    assert abs(uppers[0] - uppers[1]) <= 1e-6 * uppers[1], uppers
    assert uppers[0] >= _ball_lower(m, 1.0, "2")


class _Ids(nn.Module):
    """Token ids in, last hidden state out (explicit all-ones mask, as in `_Embeds`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, N) int64 -> (B, N, D)
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state


def _bert() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, vocab_size=50,
                                  max_position_embeddings=16, attn_implementation="eager")
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


@pytest.mark.parametrize("name", ["gpt2", "bert"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_recognition_token_id_models_start_at_the_lookup(
        tmp_path: Path, name: str, dynamo: bool) -> None:
    # GPT-2 reshapes the ids before the `wte` Gather; BERT's TorchScript export gathers its
    # position ids with GatherElements: both load, and the bound is the same as with
    # `inputs_embeds` (the continuous input is the lookup's output)
    inner = _gpt2().model if name == "gpt2" else _bert()
    ids = torch.randint(0, 50, (1, N))
    path = tmp_path / "m.onnx"
    _export(_Ids(inner), ids, path, dynamo)
    model = load_onnx(path.read_bytes())
    assert model.spec.ids_name == "x"
    got = analyse(model, "2")
    assert got.verdict == "certified", got.reason
    embeds = load_onnx(_export(_Embeds(inner), torch.randn(1, N, D), tmp_path / "e.onnx",
                               dynamo))
    ref = analyse(embeds, "2")
    assert ref.verdict == "certified" and got.upper is not None and ref.upper is not None
    if name == "gpt2":  # the position embedding is added after the lookup: same map
        assert abs(got.upper - ref.upper) <= 1e-9 * ref.upper, (got.upper, ref.upper)


def test_onnx_recognition_llama_certified_with_rotary(tmp_path: Path) -> None:
    # rotary tables are computed from position ids with Cos/Sin (constants of the input):
    # the graph loads, its RMSNorms, the rotary attention and the gated MLP's SiLU are
    # recognised, and the certificate is above the float64 Jacobian norm
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2,
                                   vocab_size=50, max_position_embeddings=16, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0,
                                   attn_implementation="eager")
    m = _Embeds(transformers.LlamaModel(cfg)).eval()
    model = load_onnx(_export(m, torch.randn(1, N, D), tmp_path / "l.onnx", False))
    got = analyse(model, "2")
    kinds = [lb.kind for lb in got.layers]
    assert kinds.count("rmsnorm") == 3
    assert "dp_mha_radius" in kinds and "activation:silu" in kinds
    assert got.verdict == "certified" and got.upper is not None
    assert "rotary" in got.method
    f64 = m.double()
    x = torch.randn(1, N, D, dtype=torch.float64)
    assert jacobian_norm(lambda z: f64(z), x, "2") <= got.upper
