"""Training loop, checkpoints and exact resume, and train_certified (train, certify, export)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import lsa_models
from lsa_models.config import ConfigError
from lsa_models.data import text_corpus
from lsa_models.lm import CharTransformerLM, LMConfig
from lsa_models.training import (
    History,
    Progress,
    TrainConfig,
    TrainingCertificate,
    TrainingDivergedError,
    evaluate_bpc,
    latest_checkpoint,
    select_device,
    train_certified,
    train_lm,
)

TINY = Path(__file__).parent / "data" / "tiny_corpus.txt"


@pytest.fixture(scope="module")
def corpus():
    return text_corpus(TINY.read_text(encoding="utf-8"), "tiny", min_split_chars=9)


def _tiny(seq_len: int):
    return text_corpus(TINY.read_text(encoding="utf-8"), "tiny", min_split_chars=seq_len + 1)


def _lm_config(corpus, kind: str = "contractive_l2") -> LMConfig:
    return LMConfig(corpus.vocab.size, 8, 2, 2, 16, 8, kind)  # type: ignore[arg-type]


def _train_config(**kw) -> TrainConfig:
    args: dict[str, Any] = dict(steps=12, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=4,
                                eval_tokens=64, checkpoint_every=4, progress_every=3, seed=7,
                                device="cpu")
    args.update(kw)
    return TrainConfig(**args)


@pytest.mark.parametrize("kind", ["contractive_l2", "dp"])
def test_resume_reproduces_the_uninterrupted_run_exactly(kind, corpus, tmp_path):
    cfg = _train_config()
    full = train_lm(_lm_config(corpus, kind), corpus, cfg, tmp_path / "a")
    part = train_lm(_lm_config(corpus, kind), corpus, cfg, tmp_path / "b", stop_at=8)
    assert part.steps_done == 8 and part.history.loss == full.history.loss[:8]
    ckpt = latest_checkpoint(tmp_path / "b")
    assert ckpt is not None and ckpt.name == "step_00000008.safetensors"
    resumed = train_lm(_lm_config(corpus, kind), corpus, cfg, tmp_path / "b", resume_from=ckpt)
    assert resumed.history.step == full.history.step == list(range(1, 13))
    assert resumed.history.loss == full.history.loss  # bit-for-bit, not approximately
    assert resumed.history.val_bpc == full.history.val_bpc
    for (name, a), b in zip(full.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_resume_refuses_changed_settings(corpus, tmp_path):
    cfg = _train_config(steps=4)
    train_lm(_lm_config(corpus), corpus, cfg, tmp_path)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None
    with pytest.raises(ConfigError) as info:
        train_lm(_lm_config(corpus), corpus, _train_config(steps=8, lr=1e-2), tmp_path,
                 resume_from=ckpt)
    assert info.value.field == "lr"
    other = LMConfig(corpus.vocab.size, 8, 2, 3, 16, 8, "contractive_l2")
    with pytest.raises(ConfigError) as info:
        train_lm(other, corpus, _train_config(steps=8), tmp_path, resume_from=ckpt)
    assert info.value.field == "model_config"


def test_checkpoints_are_safetensors_without_pickle(corpus, tmp_path):
    train_lm(_lm_config(corpus), corpus, _train_config(steps=4), tmp_path)
    model_file = tmp_path / "step_00000004.safetensors"
    state_file = tmp_path / "step_00000004.train.safetensors"
    assert isinstance(lsa_models.load(model_file), CharTransformerLM)
    with safe_open(str(state_file), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert any(k.endswith(".exp_avg_sq") for k in keys)
    assert json.loads(meta["step"]) == 4 and len(json.loads(meta["history"])["loss"]) == 4
    assert b"pickle" not in state_file.read_bytes()[:200]


def test_progress_callback_reports_step_loss_and_throughput(corpus):
    reports: list[Progress] = []
    train_lm(_lm_config(corpus, "l2"), corpus, _train_config(steps=7, checkpoint_every=0),
             progress=reports.append)
    seen = [(p.step, p.loss, p.tokens_per_s) for p in reports]
    assert [s for s, _, _ in seen] == [3, 6, 7]
    assert all(loss is not None and math.isfinite(loss) and loss > 0 and tps is not None
               and tps > 0 for _, loss, tps in seen)
    assert [p.fraction for p in reports] == [3 / 7, 6 / 7, 1.0]
    assert {p.stage for p in reports} == {"training"} and reports[0].steps == 7


def test_learning_rate_schedules():
    warm = TrainConfig(steps=10, lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [warm.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warm.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 6)))
    fixed = TrainConfig(steps=10, lr=0.5, fixed_lr=True)
    assert {fixed.lr_at(s) for s in range(10)} == {0.5}
    with pytest.raises(ConfigError) as info:
        TrainConfig(steps=10, fixed_lr=True, warmup_steps=3)
    assert info.value.field == "warmup_steps"


def test_untrained_uniform_model_scores_log2_vocab_bits(corpus):
    model = CharTransformerLM(_lm_config(corpus))
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    assert evaluate_bpc(model, corpus.valid) == pytest.approx(math.log2(corpus.vocab.size),
                                                              rel=1e-6)


def test_divergence_events_are_counted():
    h = History()
    for v in [3.0] * 30 + [5.0, 5.0, 3.0, 3.0, 6.0, 3.0]:
        h.observe(v, spike_nats=1.0)
        h.loss.append(v)
    assert h.divergence_events == 2 and not h.diverged
    h.observe(float("nan"), 1.0)
    assert h.divergence_events == 3 and h.diverged


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"steps": 0}, "steps"),
    ({"lr": float("nan")}, "lr"),
    ({"batch_size": True}, "batch_size"),
    ({"grad_clip": -1.0}, "grad_clip"),
    ({"device": "tpu"}, "device"),
    ({"fixed_lr": True, "warmup_steps": 5}, "warmup_steps"),
    ({"recon_sequences": 0}, "recon_sequences"),
    ({"inverse_atol": 0.0}, "inverse_atol"),
])
def test_train_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{"steps": 10, **kwargs})
    assert info.value.field == field


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"attention": "softmax"}, "attention"),
    ({"c": 1.0}, "c"),
    ({"c": 0.0}, "c"),
    ({"n_heads": 5}, "n_heads"),
    ({"seq_len": 0}, "seq_len"),
])
def test_lm_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        LMConfig(**{"vocab_size": 5, "d_model": 8, "n_heads": 2, **kwargs})
    assert info.value.field == field


def test_select_device():
    assert select_device("cpu").type == "cpu"
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no GPU"):
            select_device("cuda")


def test_train_certified_tiny_run_writes_model_onnx_certificate_plot(tmp_path):
    import onnxruntime as ort

    corpus = _tiny(16)
    model_cfg = LMConfig(corpus.vocab.size, 16, 2, 2, 32, 16, "contractive_l2", c=0.8)
    cfg = TrainConfig(steps=30, batch_size=8, lr=3e-3, recon_sequences=4, device="cpu",
                      checkpoint_every=10, progress_every=5)
    events: list[Progress] = []
    out = train_certified(model_cfg, cfg, corpus, tmp_path, progress=events.append)
    cert = out.certificate
    assert isinstance(cert, TrainingCertificate)
    # Every residual branch is certified contractive, hence the trunk is invertible.
    assert len(cert.branches) == 4
    assert all(b.lipschitz_upper <= 0.8 and b.contractive for b in cert.branches)
    assert cert.max_branch_lipschitz == max(b.lipschitz_upper for b in cert.branches)
    assert cert.invertible and cert.trunk_verdict == "certified"
    assert cert.trunk_lipschitz_upper is not None and cert.trunk_lipschitz_upper <= 1.8**4
    rec = cert.reconstruction
    assert rec is not None
    assert rec.converged and rec.bound_holds and rec.max_abs_error <= 1e-5
    assert cert.test_bpc is not None and 0 < cert.test_bpc < 8
    assert cert.valid_bpc is not None and math.isfinite(cert.valid_bpc)
    assert out.history.loss[-1] < out.history.loss[0]
    # Artifacts.
    model = lsa_models.load(out.model_path)
    assert isinstance(model, CharTransformerLM) and model.config.attention == "contractive_l2"
    sess = ort.InferenceSession(str(out.onnx_path), providers=["CPUExecutionProvider"])
    tokens = np.zeros((3, 16), dtype=np.int64)
    (logits,) = sess.run(None, {"tokens": tokens})
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).numpy()
    assert np.abs(logits - ref).max() < 1e-4
    assert out.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads(out.certificate_path.read_text())
    assert written["test_bpc"] == cert.test_bpc
    assert {k: v for k, v in written.items() if k != "history"} == cert.to_json()
    # Progress: monotone fractions up to 1, training reports with throughput.
    fractions = [p.fraction for p in events]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    train_events = [p for p in events if p.step is not None]
    assert train_events and all((p.tokens_per_s or 0) > 0 for p in train_events)
    # A rerun in the same directory resumes from the last checkpoint (here: the final step).
    again = train_certified(model_cfg, cfg, corpus, tmp_path)
    assert again.history.loss == out.history.loss


def test_train_certified_dp_is_not_invertible(tmp_path):
    corpus = _tiny(8)
    out = train_certified(LMConfig(corpus.vocab.size, 8, 2, 1, 16, 8, "dp"),
                          TrainConfig(steps=3, batch_size=2, device="cpu"), corpus, tmp_path)
    assert out.certificate.invertible is False and out.certificate.branches == []
    assert out.certificate.reconstruction is None
    assert "contractive_l2" in (out.certificate.invertible_reason or "")
    assert [layer.name for layer in out.certificate.layers]
    assert out.onnx_path.exists() and out.model_path.exists()


@pytest.mark.gpu
def test_train_lm_on_cuda_with_bf16_autocast(corpus):
    res = train_lm(_lm_config(corpus), corpus, _train_config(steps=6, checkpoint_every=0,
                                                              device="cuda"))
    assert res.device.startswith("cuda")
    assert all(math.isfinite(v) for v in res.history.loss)


def test_non_finite_weights_stop_the_run_as_diverged(corpus, tmp_path, monkeypatch):
    from lsa_models import invertible

    real = invertible.ContractiveTrunk.forward  # called once per training step
    calls = {"n": 0}

    def poisoned(self, x):
        calls["n"] += 1
        if calls["n"] > 3:  # fails on step 4
            with torch.no_grad():
                self.blocks[0].attn.q_proj.weight[0, 0] = float("nan")
        return real(self, x)

    monkeypatch.setattr(invertible.ContractiveTrunk, "forward", poisoned)
    res = train_lm(_lm_config(corpus), corpus, _train_config(eval_every=0, checkpoint_every=0))
    assert res.history.diverged and res.history.divergence_events == 1
    assert res.steps_done == 4 and math.isnan(res.history.loss[-1])
    assert res.history.val_bpc == []  # no evaluation of a broken model
    calls["n"] = 0
    tiny = _tiny(8)
    with pytest.raises(TrainingDivergedError, match="non-finite at step 4"):
        train_certified(LMConfig(tiny.vocab.size, 8, 2, 2, 16, 8),
                        TrainConfig(steps=12, batch_size=4, device="cpu"), tiny, tmp_path)
