"""One attention vocabulary: the same word gives the same certification outcome through the
library (`LMConfig(attention=...)` + `certify`), the command line (`lsa bound`) and the
training form of `POST /certify` (a tiny training job)."""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import lsa_models
from lsa_models.lm import CharTransformerLM, LMConfig
from service.app import create_app
from service.cli import app as cli_app
from service.settings import Settings

TINY_CORPUS = Path(__file__).resolve().parent.parent / "data" / "tiny_corpus.txt"
SHAPE: dict[str, Any] = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "seq_len": 8}
# A few steps: the outcome depends on the attention word, not on how well the model learned.
TRAINING: dict[str, Any] = {**SHAPE, "steps": 3, "batch_size": 2, "eval_tokens": 64,
                            "recon_sequences": 1, "device": "cpu", "c": 0.5}


@pytest.fixture
def vocab_client(sqlite_migrated: str,
                 make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    with TestClient(create_app(make_settings(sqlite_migrated,
                                             max_corpus_bytes=64 * 1024))) as c:
        yield c


def _trained_through_post_certify(c: TestClient, word: str) -> tuple[dict[str, Any], bytes]:
    """The signed certificate and the model file of a training request with `word`."""
    text = TINY_CORPUS.read_bytes() + f"\n{uuid.uuid4()}\n".encode()
    r = c.post("/corpora", files={"file": ("tiny.txt", io.BytesIO(text), "text/plain")})
    assert r.status_code == 201, r.text
    spec = {**TRAINING, "attention": word, "corpus": r.json()["id"]}
    r = c.post("/certify", json={"training": spec})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while (job := c.get(f"/jobs/{r.json()['job_id']}").json())["status"] in ("queued",
                                                                             "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["status"] == "succeeded", job["error"]
    cert = c.get(job["result"]["certificate_url"]).json()
    model = c.get(f"/models/{job['result']['model_id']}/file").content
    return cert, model


def _cli_verdict(path: Path) -> str:
    res = CliRunner().invoke(cli_app, ["bound", str(path), "--norm", "2", "--seq-len",
                                       str(SHAPE["seq_len"]), "--json"])
    assert res.exit_code == 0, res.output
    return str(json.loads(res.stdout)["verdict"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(("word", "tied"), [("l2", True), ("l2_untied", False),
                                            ("l2_tied", True), ("dp", None),
                                            ("contractive_l2", None)])
def test_vocabulary_word_same_outcome_in_library_cli_and_rest(
        vocab_client: TestClient, tmp_path: Path, word: str, tied: bool | None) -> None:
    # Library: a model built with the word, certified directly.
    torch.manual_seed(0)
    built = CharTransformerLM(LMConfig(vocab_size=30, **SHAPE, attention=word))  # type: ignore[arg-type]
    library_trunk = lsa_models.certify(built.trunk, 2, SHAPE["seq_len"]).verdict
    library_lm = lsa_models.certify(built.continuous_part(), 2, SHAPE["seq_len"]).verdict
    if tied is not None:  # the L2 words: tied is certifiable (Theorem 3.2), untied is not
        assert library_trunk == ("certified" if tied else "not_certified")

    # REST: a training request with the word; its certificate states the trunk's verdict.
    cert, model_bytes = _trained_through_post_certify(vocab_client, word)
    assert cert["training"]["trunk_verdict"] == library_trunk
    assert cert["training"]["attention"] == built.config.attention  # the canonical word
    trained = lsa_models.from_bytes(model_bytes)
    assert isinstance(trained, CharTransformerLM)
    assert trained.config.attention == built.config.attention
    if tied is not None:
        assert trained.trunk.blocks[0].attn.config.tied is tied  # type: ignore[union-attr]

    # CLI: the same verdict for the library's model and for the model the service trained.
    built_path = lsa_models.save(built, tmp_path / "built.safetensors")
    trained_path = tmp_path / "trained.safetensors"
    trained_path.write_bytes(model_bytes)
    assert _cli_verdict(built_path) == library_lm
    assert _cli_verdict(trained_path) == library_lm
