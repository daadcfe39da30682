"""Training character-level LMs (`train_lm`) and training then certifying them
(`train_certified`: the model, its ONNX export, the `TrainingCertificate` and a PNG of the
curves); `checkpoints` saves every K steps and resumes exactly."""

from .certificate import TrainingCertificate
from .certified import TrainOutcome, train_certified
from .checkpoints import latest_checkpoint
from .config import TrainConfig, TrainingDivergedError, select_device
from .history import LN2, History, Progress
from .loop import evaluate_bpc, train_lm

__all__ = [
    "LN2",
    "History",
    "Progress",
    "TrainConfig",
    "TrainOutcome",
    "TrainingCertificate",
    "TrainingDivergedError",
    "evaluate_bpc",
    "latest_checkpoint",
    "select_device",
    "train_certified",
    "train_lm",
]
