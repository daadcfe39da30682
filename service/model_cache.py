"""Loaded models kept in memory, least recently used first out, keyed by sha256.

Loading parses the upload (for ONNX: the checker, shape inference and the graph's constants);
an upload whose onnxruntime comparison was recorded at upload skips that comparison.
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lsa_models.loaded import LoadedModel

_threads_lock = threading.Lock()
_threads_set = False


def _one_thread() -> None:
    global _threads_set
    with _threads_lock:
        if not _threads_set:
            import torch  # deferred: importing torch takes seconds; app start-up needs none

            # Request threads and workers share few cores; one thread each is fastest.
            torch.set_num_threads(1)
            _threads_set = True


def load_bytes(data: bytes, filename: str, *, check_ort: bool = True) -> LoadedModel:
    """lsa_models' format sniffing, with every loader registered. `check_ort=False` skips the
    onnxruntime comparison of an ONNX graph (for bytes that passed it at upload)."""
    # Deferred: lsa_models imports torch.
    from lsa_models.analysis import load_model_bytes

    _one_thread()
    onnx = importlib.import_module("lsa_models.onnx")
    if not check_ort and onnx.is_onnx(data, filename):
        loaded: LoadedModel = onnx.load_onnx_model(data, filename, check_ort=False)
        return loaded
    return load_model_bytes(data, filename)


class LRU:
    """A thread-safe map keeping the `size` most recently used entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str) -> object | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: object) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class ModelCache:
    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._loading: dict[str, threading.Lock] = {}
        self.loads = 0  # models actually parsed (tests and metrics)

    def get(self, sha256: str, load: Callable[[], LoadedModel]) -> LoadedModel:
        """The model of `sha256`, loaded by `load` on a miss (once, however many threads ask
        for it at the same moment)."""
        with self._lock:
            hit = self._models.get(sha256)
            if hit is not None:
                self._models.move_to_end(sha256)
                return hit
            loading = self._loading.setdefault(sha256, threading.Lock())
        try:
            with loading:
                with self._lock:
                    hit = self._models.get(sha256)
                if hit is not None:
                    return hit
                model = load()
                with self._lock:
                    self.loads += 1
                self.put(sha256, model)
                return model
        finally:
            with self._lock:
                self._loading.pop(sha256, None)

    def put(self, sha256: str, model: LoadedModel) -> None:
        """Keep a model parsed elsewhere (an upload)."""
        with self._lock:
            self._models[sha256] = model
            while len(self._models) > self.size:
                self._models.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._models.clear()
