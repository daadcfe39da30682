"""Torch-style layer constructors, the one attention vocabulary, torch.linalg norm spellings,
and checkpoints written by format version 1 (tests/data/v1_checkpoints, made before the
vocabulary changed) loading with the meaning they were written with."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import lsa_models
from lsa_models import L2MHA, AttentionConfig, DotProductMHA, Transformer, TransformerConfig
from lsa_models.checkpoint import FORMAT_VERSION, read_metadata
from lsa_models.config import ATTENTION_NAMES, ConfigError
from lsa_models.lm import CharTransformerLM, LMConfig

V1 = Path(__file__).parent / "data" / "v1_checkpoints"


def test_attention_layers_build_from_their_own_arguments() -> None:
    l2, dp, causal = L2MHA(16, 4), DotProductMHA(16, 4), L2MHA(16, 4, causal=True)
    x = torch.randn(2, 5, 16)  # (B, N, D)
    for layer in (l2, dp, causal):
        assert layer(x).shape == (2, 5, 16)
    assert l2.config == AttentionConfig(16, 4, "l2", tied=True, causal=False)
    assert dp.config.kind == "dp" and not dp.config.causal
    assert causal.config.causal and causal.k_proj is None
    assert L2MHA(16, 4, tied=False).k_proj is not None


def test_attention_layers_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        L2MHA(16, 4, False)  # type: ignore[misc]
    with pytest.raises(TypeError):
        DotProductMHA(16, 4, True)  # type: ignore[misc]
    with pytest.raises(TypeError):
        DotProductMHA(16, 4, tied=True)  # type: ignore[call-arg]


def test_attention_layers_reject_bad_shapes_naming_the_argument() -> None:
    with pytest.raises(ConfigError) as exc:
        L2MHA(10, 4)
    assert exc.value.field == "n_heads"


def test_attention_repr_shows_heads_tied_and_causal() -> None:
    assert "n_heads=4, tied=True, causal=True" in repr(L2MHA(16, 4, causal=True))
    assert "n_heads=2, causal=False" in repr(DotProductMHA(8, 2))


def test_attention_from_config_round_trips_and_checks_the_kind() -> None:
    cfg = AttentionConfig(8, 2, "l2", tied=False, causal=True)
    assert L2MHA.from_config(cfg).config == cfg
    assert DotProductMHA.from_config(AttentionConfig(8, 2, "dp")).config.kind == "dp"
    with pytest.raises(ConfigError, match="kind"):
        DotProductMHA.from_config(AttentionConfig(8, 2))
    with pytest.raises(ConfigError, match="kind"):
        L2MHA.from_config(AttentionConfig(8, 2, "dp"))


def test_attention_same_seed_same_weights_as_from_config() -> None:
    torch.manual_seed(3)
    a = L2MHA(8, 2, causal=True)
    torch.manual_seed(3)
    b = L2MHA.from_config(AttentionConfig(8, 2, causal=True))
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


@pytest.mark.parametrize("norm", [2, 2.0, "2", float("inf"), math.inf, "inf"])
def test_certify_accepts_torch_linalg_norm_spellings(norm: str | float) -> None:
    torch.manual_seed(0)
    model = L2MHA(4, 2)
    want = "2" if norm in (2, "2") else "inf"
    got = lsa_models.certify(model, norm, 5)
    assert got.norm == want
    assert got.upper == lsa_models.certify(model, want, 5).upper


@pytest.mark.parametrize("norm", [1, "fro", -math.inf, math.nan, True])
def test_certify_rejects_other_norms(norm: object) -> None:
    with pytest.raises(ValueError, match="norm"):
        lsa_models.certify(L2MHA(4, 2), norm, 5)  # type: ignore[arg-type]


def test_vocabulary_is_the_same_in_the_wire_schema() -> None:
    from api_schemas.training import AttentionKind

    # The wire accepts the library's words plus the deprecated alias, nothing else.
    assert set(typing.get_args(AttentionKind)) == {*ATTENTION_NAMES, "l2_tied"}


@pytest.mark.parametrize("word,tied", [("l2", True), ("l2_untied", False)])
def test_vocabulary_l2_means_the_same_in_transformer_and_lm(word: str, tied: bool) -> None:
    stack = Transformer(TransformerConfig(8, 2, 1, 16, attention=word))  # type: ignore[arg-type]
    lm = CharTransformerLM(LMConfig(5, 8, 2, 1, 16, 4, attention=word))  # type: ignore[arg-type]
    assert stack.blocks[0].attn.config.tied is tied
    assert lm.trunk.blocks[0].attn.config.tied is tied  # type: ignore[union-attr]
    verdicts = {lsa_models.certify(m, "2", 4).verdict for m in (stack, lm.continuous_part())}
    assert verdicts == ({"certified"} if tied else {"not_certified"})


def test_vocabulary_old_alias_warns_and_means_tied() -> None:
    with pytest.warns(DeprecationWarning, match="l2_tied"):
        cfg = LMConfig(5, 8, 2, 1, 16, 4, attention="l2_tied")  # type: ignore[arg-type]
    assert cfg.attention == "l2"
    with pytest.warns(DeprecationWarning):
        assert TransformerConfig(8, 2, 1, 16, attention="l2_tied").attention == "l2"  # type: ignore[arg-type]


def test_vocabulary_unknown_word_names_the_choices() -> None:
    with pytest.raises(ConfigError) as exc:
        LMConfig(5, attention="l3")  # type: ignore[arg-type]
    assert exc.value.field == "attention" and "l2_untied" in exc.value.message
    with pytest.raises(ConfigError, match="attention"):
        TransformerConfig(8, 2, 1, 16, attention="contractive_l2")  # type: ignore[arg-type]


def _v1_config(path: Path) -> dict[str, object]:
    meta = read_metadata(path.read_bytes())
    assert meta["format_version"] == "1"
    return dict(json.loads(meta["config"]))


# file -> (the layer type, tied) the version-1 writer meant
V1_EXPECTED = {
    "l2_mha": (L2MHA, True),
    "l2_mha_untied": (L2MHA, False),
    "dp_mha": (DotProductMHA, None),
    "transformer_untied": (L2MHA, False),
    "lm_l2": (L2MHA, False),  # v1 language models: "l2" was the untied layer
    "lm_l2_tied": (L2MHA, True),
    "lm_dp": (DotProductMHA, None),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", sorted(V1_EXPECTED))
def test_checkpoint_v1_loads_with_its_meaning(name: str) -> None:
    layer_type, tied = V1_EXPECTED[name]
    path = V1 / f"{name}.safetensors"
    model = lsa_models.load(path)
    attn = next(m for m in model.modules() if isinstance(m, (L2MHA, DotProductMHA)))
    assert type(attn) is layer_type
    if tied is not None:
        assert attn.config.tied is tied
    # Saved again, it is a version-2 checkpoint that loads to the same model.
    again = lsa_models.from_bytes(lsa_models.to_bytes(model))
    assert read_metadata(lsa_models.to_bytes(model))["format_version"] == FORMAT_VERSION
    assert again.config == model.config  # type: ignore[union-attr]
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_checkpoint_v1_lm_certifies_like_a_new_one() -> None:
    """The certification outcome of a v1 LM equals that of the same weights in a model built
    today with the word that now means what the old one meant."""
    for name, word in (("lm_l2", "l2_untied"), ("lm_l2_tied", "l2"), ("lm_dp", "dp"),
                       ("lm_contractive_l2", "contractive_l2")):
        old = lsa_models.load(V1 / f"{name}.safetensors")
        assert isinstance(old, CharTransformerLM)
        cfg = _v1_config(V1 / f"{name}.safetensors")
        new = CharTransformerLM(LMConfig(**{**cfg, "attention": word}))  # type: ignore[arg-type]
        new.load_state_dict(old.state_dict())
        for norm in ("2", "inf"):
            a = lsa_models.certify(old.continuous_part(), norm, 4)
            b = lsa_models.certify(new.continuous_part(), norm, 4)
            assert (a.verdict, a.upper) == (b.verdict, b.upper), (name, norm)


def test_checkpoint_refuses_a_newer_format_version() -> None:
    from safetensors.torch import save as st_save

    model: nn.Module = L2MHA(4, 2)
    meta = {"format": "lsa-native", "format_version": "99", "kind": "l2_mha",
            "config": json.dumps({"d_model": 4, "n_heads": 2})}
    with pytest.raises(lsa_models.CheckpointError) as exc:
        lsa_models.from_bytes(st_save(dict(model.state_dict()), metadata=meta))
    assert exc.value.field == "format_version"
