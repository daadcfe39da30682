"""torch's two ONNX exporters as the tests call them (one place, so every test exports alike)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor, nn


def export_to(module: nn.Module, x: Tensor, path: Path, dynamo: bool,
              opset: int | None = None) -> Path:
    """Export `module` at input `x` to `path` (input "x", output "y") with the dynamo exporter
    (default opset 18) or the TorchScript one (default opset 17, the zoo's); weights inline."""
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter chatter (tracer and dynamo warnings)
        if dynamo:
            prog = torch.onnx.export(module, (x,), dynamo=True, opset_version=opset or 18,
                                     input_names=["x"], output_names=["y"], verbose=False)
            assert prog is not None
            prog.save(str(path), external_data=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=opset or 17,
                              input_names=["x"], output_names=["y"])
    return path
