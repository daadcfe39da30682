"""`export_onnx`: write an lsa_models model as an ONNX graph the analyser recognises.

L2 attention layers are exported through `L2MHA.forward_export` (explicit logits and a value
path that keeps W^V separate), everything else through its ordinary forward.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..attention import L2MHA


@contextlib.contextmanager
def _export_forms(model: nn.Module, form: str) -> Iterator[None]:
    patched = []
    for mod in model.modules():
        if isinstance(mod, L2MHA):
            def fwd(x: torch.Tensor, _m: L2MHA = mod) -> torch.Tensor:
                return L2MHA.forward_export(_m, x, form)

            mod.forward = fwd  # type: ignore[method-assign]
            patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            del mod.forward


def export_onnx(model: nn.Module, path: str | os.PathLike[str], seq_len: int, *,
                opset: int = 18, dynamo: bool = True, batch: int = 1,
                dynamic_seq_len: bool = False, form: str = "pairwise",
                d_model: int | None = None) -> Path:
    """Export `model` ((B, N, D) -> (B, N, D)) for inputs of `seq_len` tokens.

    `dynamo=True` uses torch.export (onnxscript); `dynamo=False` the TorchScript exporter.
    Weights are stored inside the .onnx file. `dynamic_seq_len` marks N as dynamic.
    """
    if opset < 17:
        raise ValueError(f"opset {opset} is too old; use 17 or later")
    dim = d_model or getattr(getattr(model, "config", None), "d_model", None)
    if dim is None:
        raise ValueError("cannot tell the model's width D; pass d_model=")
    path = Path(path)
    was_training = model.training
    model.eval()
    x = torch.randn(batch, seq_len, int(dim))
    kwargs: dict = {"input_names": ["x"], "output_names": ["y"], "opset_version": opset}
    if dynamic_seq_len:
        if dynamo:
            kwargs["dynamic_shapes"] = {"x": {1: torch.export.Dim("seq", min=2, max=4096)}}
        else:
            kwargs["dynamic_axes"] = {"x": {1: "seq"}, "y": {1: "seq"}}
    try:
        with _export_forms(model, form), warnings.catch_warnings(), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            if dynamo:
                prog = torch.onnx.export(model, (x,), dynamo=True, **kwargs)
                assert prog is not None
                prog.save(str(path), external_data=False)
            else:
                torch.onnx.export(model, (x,), str(path), dynamo=False, **kwargs)
    finally:
        model.train(was_training)
    return path
