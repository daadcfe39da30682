"""The typed certificate of a trained language model: what `train_certified` measured and
certified, with `to_json()` for the signed certificate body (strict JSON)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..bounds import certify
from ..data import eval_windows
from ..invertible import ContractiveTrunk
from ..lm import CharTransformerLM

NOT_INVERTIBLE_REASON = ("only attention='contractive_l2' scales its residual branches to a "
                         "certified constant c < 1")


@dataclass(frozen=True)
class BranchBound:
    """One residual branch of a contractive trunk: its certified Lip_2 upper bound."""

    name: str
    kind: str
    lipschitz_upper: float
    contractive: bool  # lipschitz_upper <= c < 1


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a non-contractive trunk, as the bound analyser reports it."""

    name: str
    kind: str
    lipschitz_upper: float | None
    status: str


@dataclass(frozen=True)
class Reconstruction:
    """The float64 certified inverse of the trunk on held-out test sequences."""

    sequences: int
    seq_len: int
    dtype: str
    converged: bool
    max_error: float
    max_relative_error: float
    max_abs_error: float
    error_bound: float  # a-posteriori bound of the fixed-point iteration
    bound_holds: bool
    iterations_per_block: list[int]
    predicted_iterations_per_block: list[int | None]
    atol: float


@dataclass
class TrainingCertificate:
    """`norm` is "2"; `trunk_*` come from `bounds.certify` of the trunk. A contractive trunk
    has `branches` (every one <= c < 1 when `invertible`), its inverse's Lipschitz bound and a
    `reconstruction`; other trunks have the analyser's `layers` and an `invertible_reason`.
    `onnx_max_abs_diff` compares onnxruntime's logits with torch's; `tokens_per_s` is the mean
    over progress intervals."""

    norm: str
    seq_len: int
    attention: str
    c: float
    trunk_verdict: str
    trunk_lipschitz_upper: float | None
    trunk_reason: str | None
    method: str
    invertible: bool
    branches: list[BranchBound] = field(default_factory=list)
    trunk_inverse_lipschitz_upper: float | None = None
    reconstruction: Reconstruction | None = None
    layers: list[LayerEntry] = field(default_factory=list)
    invertible_reason: str | None = None
    test_bpc: float | None = None
    valid_bpc: float | None = None
    steps: int = 0
    divergence_events: int = 0
    onnx_max_abs_diff: float | None = None
    tokens_per_s: float = 0.0
    device: str = ""

    @property
    def max_branch_lipschitz(self) -> float | None:
        """The largest certified branch constant; None without branches or with a
        non-finite one."""
        uppers = [b.lipschitz_upper for b in self.branches]
        if not uppers or not all(math.isfinite(u) for u in uppers):
            return None
        return max(uppers)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON (non-finite numbers become null: PostgreSQL's jsonb and most parsers
        reject NaN and Infinity)."""
        return json_safe(dataclasses.asdict(self))


def json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def reconstruction_check(model: CharTransformerLM, data: Tensor, n_sequences: int,
                         atol: float) -> Reconstruction:
    """Invert the trunk (float64 copy, CPU) on held-out sequences' embeddings and compare."""
    if not isinstance(model.trunk, ContractiveTrunk):
        raise TypeError("only a contractive trunk has a certified inverse")
    seq_len = model.config.seq_len
    x_ids, _ = eval_windows(data, seq_len)  # (W, N)
    step = max(1, x_ids.shape[0] // n_sequences)
    ids = x_ids[::step][:n_sequences]  # (S, N), spread over the split
    cpu_model = CharTransformerLM(model.config)
    cpu_model.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    cpu_model.double().eval()
    trunk = cpu_model.trunk
    assert isinstance(trunk, ContractiveTrunk)  # same config as model's
    with torch.no_grad():
        x = cpu_model.embed(ids)  # (S, N, D) float64
        y = trunk(x)  # (S, N, D)
        res = trunk.inverse(y, atol=atol, max_iter=10_000)
    err = (res.x - x).flatten(1).norm(dim=1)  # (S,)
    rel = err / x.flatten(1).norm(dim=1)  # (S,)
    return Reconstruction(
        sequences=int(ids.shape[0]), seq_len=seq_len, dtype="float64",
        converged=bool(res.converged), max_error=float(err.max()),
        max_relative_error=float(rel.max()), max_abs_error=float((res.x - x).abs().max()),
        error_bound=float(res.error_bound), bound_holds=bool(float(err.max()) <= res.error_bound),
        iterations_per_block=[b.iterations for b in res.blocks],
        predicted_iterations_per_block=[b.predicted_iterations for b in res.blocks], atol=atol)


def certify_trained(model: CharTransformerLM, test_data: Tensor, recon_sequences: int,
                    inverse_atol: float) -> TrainingCertificate:
    """The trunk's certified 2-norm bound; for a contractive trunk also every branch's bound,
    the inverse's and the reconstruction check on `test_data`."""
    cfg = model.config
    result = certify(model.trunk, "2", cfg.seq_len)
    cert = TrainingCertificate(
        norm="2", seq_len=cfg.seq_len, attention=cfg.attention, c=cfg.c,
        trunk_verdict=result.verdict, trunk_lipschitz_upper=result.upper,
        trunk_reason=result.reason, method=result.method, invertible=False)
    trunk = model.trunk
    if not isinstance(trunk, ContractiveTrunk):
        cert.layers = [LayerEntry(lb.name, lb.kind, lb.upper, lb.status) for lb in result.layers]
        cert.invertible_reason = NOT_INVERTIBLE_REASON
        return cert
    with torch.no_grad():
        for i, blk in enumerate(trunk.residual_blocks()):
            lip = blk.lipschitz_upper(cfg.seq_len)
            upper = math.inf if lip is None else float(lip)
            cert.branches.append(BranchBound(f"trunk.blocks.{i}", type(blk).__name__, upper,
                                             upper <= cfg.c < 1.0))
        cert.trunk_inverse_lipschitz_upper = trunk.inverse_lipschitz_upper(cfg.seq_len)
    cert.invertible = all(b.contractive for b in cert.branches)
    cert.reconstruction = reconstruction_check(model, test_data, recon_sequences, inverse_atol)
    return cert


__all__ = ["BranchBound", "LayerEntry", "Reconstruction", "TrainingCertificate",
           "certify_trained", "json_safe", "reconstruction_check"]
