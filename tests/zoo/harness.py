"""Export a zoo case, run lsa on it, and bound it from below in float64."""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lsa_models.onnx import OnnxLoadError, analyse, load_onnx
from tests.jacobians import ascend, jacobian_norm

from .cases import Built, Case

OPSET = {"torchscript": 17, "dynamo": 18}


@dataclass
class Outcome:
    """One row of the table: what lsa said about one export."""

    model: str
    exporter: str
    layout: str
    expected: str
    verdict: str  # certified | not_lipschitz | not_certified | refused (CLI exit 2)
    reason: str | None
    upper: float | None
    lower: float | None
    seconds: float

    @property
    def ratio(self) -> float | None:
        if self.upper is None or self.lower is None or self.lower <= 0:
            return None
        return self.upper / self.lower

    def row(self) -> dict[str, object]:
        return {**asdict(self), "ratio": self.ratio}


def export(built: Built, exporter: str, path: Path) -> Path:
    """`torch.onnx.export` with either exporter, fixed shapes, one input `x`, one output."""
    module = built.module.eval()
    # not under torch.no_grad(): torch's fused encoder/MHA fast paths cannot be exported
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            prog = torch.onnx.export(module, (built.example,), dynamo=True,
                                     opset_version=OPSET[exporter], input_names=["x"],
                                     output_names=["y"], verbose=False)
            assert prog is not None
            prog.save(str(path), external_data=False)
        else:
            torch.onnx.export(module, (built.example,), str(path), dynamo=False,
                              opset_version=OPSET[exporter], input_names=["x"],
                              output_names=["y"])
    return path


def run_lsa(case: Case, exporter: str, path: Path) -> Outcome:
    """Load and analyse (2-norm) as `lsa bound` does; a load error is the CLI's exit 2."""
    t0 = time.perf_counter()
    verdict: str
    try:
        result = analyse(load_onnx(path.read_bytes(), path.name), "2")
        verdict, reason, upper = result.verdict, result.reason, result.upper
    except (OnnxLoadError, ValueError) as exc:
        verdict, reason, upper = "refused", str(exc), None
    seconds = time.perf_counter() - t0
    return Outcome(case.model, exporter, case.layout, case.expected, verdict,
                   None if reason is None else " ".join(reason.split())[:300], upper, None,
                   seconds)


def lower_bound(built: Built, starts: int = 2, steps: int = 3) -> float:
    """max ||J(x)||_2 of the float64 torch module over a short Jacobian ascent from seeded
    starts: any input's Jacobian norm is a lower bound on the Lipschitz constant."""
    f64: nn.Module = copy.deepcopy(built.continuous).to(torch.float64).eval()

    def f(z: Tensor) -> Tensor:
        return f64(z)

    gen = torch.Generator().manual_seed(0)
    best = 0.0
    for _ in range(starts):
        x = torch.randn(*built.continuous_shape, generator=gen, dtype=torch.float64)
        try:
            best = max(best, ascend(f, x, "2", steps)[1])
        except NotImplementedError:
            # no forward-mode AD for some ops (torch.cdist): the ascent's jvp fails; the
            # Jacobian norm at the start is still a lower bound
            best = max(best, jacobian_norm(f, x, "2"))
    return best
