"""Let CPU torch import the registry's torchvision (a CUDA build) without its C ops.

timm and transformers' ViT import torchvision (for its transforms). The registry's
torchvision 0.28.0 wheel is installed with `--no-deps` (so pip keeps the CPU torch); its C
extension does not load against CPU torch, and its import then fails registering fake
kernels for `torchvision::nms` / `qnms`, operators that only the C extension defines. The zoo
uses none of torchvision's ops: declaring the two schemas (no kernels) lets the import
finish. Import this module before timm or transformers.
"""

from __future__ import annotations

import torch

_LIB: torch.library.Library | None = None


def declare() -> None:
    global _LIB
    if _LIB is not None:
        return
    try:
        torch.ops.torchvision.nms  # noqa: B018  (defined: the C extension loaded)
        return
    except (AttributeError, RuntimeError):
        pass
    _LIB = torch.library.Library("torchvision", "DEF")  # kept alive: the schemas live with it
    for op in ("nms", "qnms"):
        _LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


declare()
