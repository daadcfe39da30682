"""Native checkpoints: safetensors + JSON config; every malformed file fails naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

import lsa_models
from lsa_models import CheckpointError, Transformer, TransformerConfig
from lsa_models.checkpoint import from_bytes, to_bytes


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16,
                                         causal=True, final_norm=True))


def _with_metadata(meta: dict[str, str], tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    return st_save(tensors if tensors is not None else dict(_model().state_dict()),
                   metadata=meta)


def test_checkpoint_round_trip_restores_outputs_exactly(tmp_path: Path) -> None:
    model = _model().eval()
    path = lsa_models.save(model, tmp_path / "m.safetensors")
    loaded = lsa_models.load(path)
    assert loaded.config == model.config
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["l2_mha", "dp_mha", "block"])
def test_checkpoint_round_trips_every_registered_kind(kind: str) -> None:
    from lsa_models import (
        L2MHA,
        AttentionConfig,
        BlockConfig,
        DotProductMHA,
        FFNConfig,
        TransformerBlock,
    )

    model = {
        "l2_mha": lambda: L2MHA(4, 2),
        "dp_mha": lambda: DotProductMHA(4, 2),
        "block": lambda: TransformerBlock(BlockConfig(AttentionConfig(4, 2), FFNConfig(4, 8))),
    }[kind]()
    loaded = from_bytes(to_bytes(model))
    assert type(loaded) is type(model)


def test_checkpoint_file_is_not_pickle(tmp_path: Path) -> None:
    data = to_bytes(_model())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    assert header["__metadata__"]["format"] == "lsa-native"
    assert json.loads(header["__metadata__"]["config"])["n_layers"] == 2


@pytest.mark.parametrize(
    "data,field",
    [
        (b"", "file"),
        (b"\x80\x04\x95 definitely a pickle", "file"),
        (b"PK\x03\x04" + b"\x00" * 64, "file"),
    ],
)
def test_checkpoint_rejects_non_safetensors(data: bytes, field: str) -> None:
    with pytest.raises(CheckpointError) as exc:
        from_bytes(data)
    assert exc.value.field == field


def test_checkpoint_without_config_names_the_metadata() -> None:
    data = st_save(dict(_model().state_dict()))
    with pytest.raises(CheckpointError) as exc:
        from_bytes(data)
    assert exc.value.field == "__metadata__"


def test_checkpoint_with_unknown_kind_names_the_kind() -> None:
    cfg = json.dumps({"d_model": 8})
    with pytest.raises(CheckpointError, match="unknown layer kind 'resnet'") as exc:
        from_bytes(_with_metadata({"format": "lsa-native", "kind": "resnet", "config": cfg}))
    assert exc.value.field == "kind"


def test_checkpoint_with_heads_not_dividing_width_names_the_field() -> None:
    cfg = json.loads(json.dumps(lsa_models.config.config_to_dict(_model().config)))
    cfg["n_heads"] = 3
    meta = {"format": "lsa-native", "kind": "transformer", "config": json.dumps(cfg)}
    with pytest.raises(CheckpointError, match="not divisible") as exc:
        from_bytes(_with_metadata(meta))
    assert exc.value.field == "config.n_heads"


def test_checkpoint_with_bad_config_json_names_config() -> None:
    meta = {"format": "lsa-native", "kind": "transformer", "config": "{not json"}
    with pytest.raises(CheckpointError) as exc:
        from_bytes(_with_metadata(meta))
    assert exc.value.field == "config"


def test_checkpoint_with_unknown_config_field_names_it() -> None:
    cfg = lsa_models.config.config_to_dict(_model().config)
    cfg["dropout"] = 0.1
    meta = {"format": "lsa-native", "kind": "transformer", "config": json.dumps(cfg)}
    with pytest.raises(CheckpointError) as exc:
        from_bytes(_with_metadata(meta))
    assert exc.value.field == "config.dropout"


def test_checkpoint_with_wrong_tensor_shape_names_the_tensor() -> None:
    model = _model()
    tensors = dict(model.state_dict())
    tensors["blocks.0.attn.q_proj.weight"] = torch.zeros(8, 4)
    meta = {"format": "lsa-native", "kind": "transformer",
            "config": json.dumps(lsa_models.config.config_to_dict(model.config))}
    with pytest.raises(CheckpointError, match="shape") as exc:
        from_bytes(_with_metadata(meta, tensors))
    assert exc.value.field == "blocks.0.attn.q_proj.weight"


def test_checkpoint_with_missing_tensor_names_it() -> None:
    model = _model()
    tensors = dict(model.state_dict())
    del tensors["blocks.1.ln2.weight"]
    meta = {"format": "lsa-native", "kind": "transformer",
            "config": json.dumps(lsa_models.config.config_to_dict(model.config))}
    with pytest.raises(CheckpointError) as exc:
        from_bytes(_with_metadata(meta, tensors))
    assert exc.value.field == "blocks.1.ln2.weight"


def test_checkpoint_with_nan_weights_is_rejected() -> None:
    model = _model()
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    tensors["blocks.0.ffn.fc1.weight"][0, 0] = float("nan")
    meta = {"format": "lsa-native", "kind": "transformer",
            "config": json.dumps(lsa_models.config.config_to_dict(model.config))}
    with pytest.raises(CheckpointError, match="NaN"):
        from_bytes(_with_metadata(meta, tensors))


def test_checkpoint_with_zero_layernorm_eps_is_rejected() -> None:
    cfg = lsa_models.config.config_to_dict(_model().config)
    cfg["ln_eps"] = 0.0
    meta = {"format": "lsa-native", "kind": "transformer", "config": json.dumps(cfg)}
    with pytest.raises(CheckpointError) as exc:
        from_bytes(_with_metadata(meta))
    assert exc.value.field == "config.ln_eps"
