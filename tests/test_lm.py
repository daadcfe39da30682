"""The causal character-level LM: kinds, causality, checkpoints, certificates of its trunk."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lsa_models
from lsa_models import certify
from lsa_models.config import ATTENTION_NAMES, ConfigError
from lsa_models.invertible import ContractiveTrunk
from lsa_models.lm import CharTransformerLM, LMConfig


def _model(kind: str, layers: int = 2, seed: int = 0) -> CharTransformerLM:
    torch.manual_seed(seed)
    return CharTransformerLM(LMConfig(11, 8, 2, layers, 16, 6, kind)).eval()  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ATTENTION_NAMES)
def test_lm_logits_shape_and_causality(kind):
    model = _model(kind)
    idx = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx)
        assert logits.shape == (3, 6, 11)
        changed = idx.clone()
        changed[:, 4:] = (changed[:, 4:] + 1) % 11  # only the last two positions differ
        logits2 = model(changed)
    torch.testing.assert_close(logits2[:, :4], logits[:, :4], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits2[:, 4:], logits[:, 4:])
    # Shorter prefixes are valid inputs too.
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, :3]), logits[:, :3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ATTENTION_NAMES)
def test_lm_save_load_roundtrip(kind, tmp_path):
    model = _model(kind, seed=4)
    path = lsa_models.save(model, tmp_path / "lm.safetensors")
    loaded = lsa_models.load(path)
    assert isinstance(loaded, CharTransformerLM)
    assert loaded.config == model.config
    idx = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)


def test_lm_trunk_kinds():
    assert isinstance(_model("contractive_l2").trunk, ContractiveTrunk)
    tied = _model("l2").trunk.blocks[0].attn  # type: ignore[union-attr]
    untied = _model("l2_untied").trunk.blocks[0].attn  # type: ignore[union-attr]
    assert tied.config.tied and not untied.config.tied
    assert tied.config.causal and untied.config.causal


def test_lm_trunk_certificates_by_kind():
    c = certify(_model("contractive_l2", layers=3).trunk, "2", 6)
    assert c.verdict == "certified" and c.upper is not None
    assert c.upper <= 1.9**6  # six residual blocks, each branch <= 0.9
    assert certify(_model("l2_untied").trunk, "2", 6).verdict == "not_certified"
    # Bare DP attention is not Lipschitz (Theorem 3.1); inside pre-norm blocks its input is
    # bounded by LayerNorm, which is the analyser's business, not this model's.
    assert certify(_model("dp").trunk.blocks[0].attn, "2", 6).verdict == "not_lipschitz"
    assert certify(_model("l2").trunk, "2", 6).verdict == "certified"


def test_lm_any_depth_trains_a_step():
    model = CharTransformerLM(LMConfig(7, 8, 2, 5, 16, 4, "contractive_l2"))
    idx = torch.randint(0, 7, (2, 4))
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # The attention weights learn through the surrogate of U.
    attn = model.trunk.blocks[0].attn  # type: ignore[union-attr]
    assert attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"attention": "softmax"}, "attention"),
    ({"n_heads": 3}, "n_heads"),
    ({"c": 1.0}, "c"),
    ({"seq_len": 0}, "seq_len"),
    ({"n_layers": -1}, "n_layers"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"activation": "swish"}, "activation"),
])
def test_lm_config_errors_name_the_field(kwargs, field):
    args: dict[str, Any] = {"vocab_size": 5, "d_model": 8, "n_heads": 2,
                            "attention": "contractive_l2"}
    args.update(kwargs)
    with pytest.raises(ConfigError) as info:
        LMConfig(**args)
    assert info.value.field == field


def test_lm_rejects_sequences_longer_than_seq_len():
    model = _model("dp")
    with pytest.raises(ValueError, match="seq_len=6"):
        model(torch.zeros(1, 7, dtype=torch.int64))
