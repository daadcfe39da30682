"""Training character-level LMs (`train_lm`) and training then certifying them
(`train_certified`).

- `config`: `TrainConfig`, the optimisation settings (the model's shape is `lm.LMConfig`);
- `history`: the per-step `History` and the one progress protocol (`Progress` reports);
- `checkpoints`: checkpoints every K steps, safetensors only, exact resume;
- `loop`: `train_lm` and `evaluate_bpc`;
- `certificate`: the typed `TrainingCertificate` of a trained model;
- `certified`: `train_certified`, which writes the model, its ONNX export, the certificate
  and a PNG of the curves.
"""

from .certificate import (
    BranchBound,
    LayerEntry,
    Reconstruction,
    TrainingCertificate,
    certify_trained,
    reconstruction_check,
)
from .certified import TrainOutcome, train_certified
from .checkpoints import latest_checkpoint, save_checkpoint
from .config import TrainConfig, TrainingDivergedError, select_device
from .history import LN2, History, Progress, ProgressCallback
from .loop import TrainResult, evaluate_bpc, train_lm

__all__ = [
    "LN2",
    "BranchBound",
    "History",
    "LayerEntry",
    "Progress",
    "ProgressCallback",
    "Reconstruction",
    "TrainConfig",
    "TrainOutcome",
    "TrainResult",
    "TrainingCertificate",
    "TrainingDivergedError",
    "certify_trained",
    "evaluate_bpc",
    "latest_checkpoint",
    "reconstruction_check",
    "save_checkpoint",
    "select_device",
    "train_certified",
    "train_lm",
]
