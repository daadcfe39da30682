"""The golden corpus: which models, which inputs, and what is computed on each, in both norms.

Groups (every model built from seeds, nothing downloads):

- ``classifiers``: the three small classifiers of bench/local_models.py (mlp, tf1, tf2: D=16,
  N=8, 4 classes) and its ReLU MLP. Global bound, local constant at LOCAL_EPS, certified
  radius at the first centre, set verdicts at SET_FRACTION of the first centre's first-order
  radius on SET_SIZE centres.
- ``zoo``: every case of tests/zoo/cases.py with every exporter, the global bound at the
  model's own N (the zoo test's call, in both norms), with the zoo's float64 Jacobian ascent
  as the lower bound.
- ``zoo-local``: ZOO_LOCAL, one export of each of those zoo models on a float layout (the
  cases bench/local_zoo.py bounds): the local constant at LOCAL_EPS.
- ``trained``: the digits MLP and CNN of bench/trained (trained once by
  ``bench/trained/train.py --out bench/out/golden/trained``): global bound, local constant,
  certified radius on the first correctly classified test image, set verdicts on the first
  SET_SIZE of them. ``trained-vit`` (not in the default corpus): its ViTs.

Every model is exported once and frozen under the model cache (bench/out/golden/models/: the
ONNX bytes, the graph inputs as .npy, the labels and set radii as JSON), so two records (before
and after a change of the engine) bound the same bytes at the same inputs; `materialise`
builds what is missing. Sizes: the default corpus (264 items) took 400 s of one core
(cpu seconds) on the 2-core development machine, 21 minutes of wall-clock time under a load of
about 8; the budget is 15 minutes of one core.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "out" / "golden"
MODELS = OUT / "models"
TRAINED = (OUT / "trained", ROOT / "bench" / "out" / "trained")
NORMS: tuple[str, ...] = ("2", "inf")
LOCAL_EPS = 1e-2  # the ball of the local constants (bench/local_zoo.py's default)
SET_SIZE = 3  # inputs per set verdict
SET_FRACTION = 0.6  # the set radius, of the first input's float64 first-order radius
TRAINED_NAMES = ("mlp", "cnn")
# the trained ViTs (group trained-vit, not in the default corpus: torch_encoder_vit's radius
# search alone took over 3 minutes of one core): global bound and local constant, and the
# radius and set verdicts of the RADIUS_TRAINED ones
TRAINED_VITS = ("torch_encoder_vit", "lsa_l2_vit", "paper_l2_vit", "timm_vit", "xt_vit")
RADIUS_TRAINED = ("mlp", "cnn", "torch_encoder_vit")
# the zoo models whose local constants are recorded (model, layout, exporter): one export of
# each model family that bench/local_zoo.py certifies or refuses on a float layout
ZOO_LOCAL: tuple[tuple[str, str, str], ...] = (
    ("l2-broadcast-residual", "(1, N, D)", "torchscript"),
    ("l2-cdist", "(1, N, D)", "torchscript"),
    ("l2-stpp-causal-1e9", "(N, 1, D)", "torchscript"),
    ("l2-einsum-folded-residual-2", "(1, N, D)", "torchscript"),
    ("torch-encoder-prenorm", "(N, D)", "torchscript"),
    ("torch-decoder-prenorm", "(1, N, D)", "torchscript"),
    ("hf-gpt2", "inputs_embeds", "torchscript"),
    ("hf-bert", "inputs_embeds", "torchscript"),
    ("timm-vit", "patches", "torchscript"),
)


@dataclass(frozen=True)
class Case:
    """One model of the corpus and what is computed on it (per norm in `norms`)."""

    name: str  # "group/model"
    group: str
    export: Callable[[Path], dict[str, Any]]  # writes model.onnx (+ inputs); returns meta
    local: bool = False  # the local constant at LOCAL_EPS on the first input
    radius: bool = False  # the certified radius of the first input's label
    set: bool = False  # set verdicts on the inputs at the meta's set radius
    lower: Callable[[str], float | None] | None = None  # a float64 global lower bound
    attack_restarts: int = 3  # the radius search's PGD restarts (robustness's default)
    norms: tuple[str, ...] = NORMS

    @property
    def slug(self) -> str:
        return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in self.name)


@dataclass
class Frozen:
    """A materialised case: the ONNX bytes, the graph inputs (K, ...) in float64, labels."""

    onnx: bytes
    inputs: np.ndarray
    labels: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.onnx).hexdigest()


def materialise(case: Case, models: Path = MODELS) -> Frozen:
    """The case's frozen files (built and written first where missing)."""
    d = models / case.slug
    if not (d / "meta.json").is_file():
        d.mkdir(parents=True, exist_ok=True)
        meta = case.export(d)
        (d / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    meta = json.loads((d / "meta.json").read_text())
    inputs = np.load(d / "inputs.npy", allow_pickle=False)
    return Frozen((d / "model.onnx").read_bytes(), inputs, list(meta.get("labels", [])), meta)


# ---- float64 helpers (no engine: the same numbers before and after a change) ---------------


def graph_f64(onnx: bytes) -> torch.nn.Module:
    from lsa_models.onnx import load_onnx

    return load_onnx(onnx, "model.onnx").module.with_dtype(torch.float64)


def first_order_radius(f64: torch.nn.Module, x: np.ndarray, label: int, norm: str) -> float:
    """min_j m_j / ||grad m_j(X0)||_dual in float64 by autograd (a guess of the radius, used
    to place the set radius only)."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)).requires_grad_(True)
    out = f64(t).reshape(-1)
    best = math.inf
    for j in range(out.numel()):
        if j == label:
            continue
        (g,) = torch.autograd.grad(out[label] - out[j], t, retain_graph=True)
        dual = float(g.abs().sum()) if norm == "inf" else float(g.norm())
        if dual > 0:
            best = min(best, float((out[label] - out[j]).detach()) / dual)
    return best


def _predicted(f64: torch.nn.Module, inputs: np.ndarray) -> list[int]:
    with torch.no_grad():
        return [int(f64(torch.from_numpy(x)).reshape(-1).argmax()) for x in inputs]


def _classifier_meta(d: Path, onnx: bytes, inputs: np.ndarray, labels: list[int] | None,
                     **extra: Any) -> dict[str, Any]:
    """Writes inputs.npy; the labels (predicted where not given) and the set radii."""
    f64 = graph_f64(onnx)
    labels = labels if labels is not None else _predicted(f64, inputs)
    np.save(d / "inputs.npy", inputs, allow_pickle=False)
    radii = {n: SET_FRACTION * first_order_radius(f64, inputs[0], labels[0], n) for n in NORMS}
    return {"labels": labels, "set_radius": radii, **extra}


# ---- classifiers ------------------------------------------------------------------------


def _export_classifier(kind: str) -> Callable[[Path], dict[str, Any]]:
    def run(d: Path) -> dict[str, Any]:
        from bench.local_models import build, center, export, relu_mlp

        model = relu_mlp(0) if kind == "relu_mlp" else build(kind, seed=0)
        export(model, d / "model.onnx")
        xs = np.stack([center(s).numpy().astype(np.float64) for s in range(1, SET_SIZE + 1)])
        return _classifier_meta(d, (d / "model.onnx").read_bytes(), xs, None,
                                source=f"bench.local_models {kind} seed 0, centres 1..")
    return run


# the classifiers whose radius and set verdicts are recorded (tf2's radius search alone takes
# about as long as the rest of the group: its global bound and local constant only)
RADIUS_CLASSIFIERS = ("mlp", "tf1", "relu_mlp")


def classifiers() -> list[Case]:
    return [Case(f"classifiers/{k}", "classifiers", _export_classifier(k), local=True,
                 radius=k in RADIUS_CLASSIFIERS, set=k in RADIUS_CLASSIFIERS)
            for k in ("mlp", "tf1", "tf2", "relu_mlp")]


# ---- the zoo ------------------------------------------------------------------------------


def _zoo_case(model: str, layout: str) -> Any:
    from tests.zoo.cases import CASES

    return next(c for c in CASES if c.model == model and c.layout == layout)


def _export_zoo(model: str, layout: str, exporter: str) -> Callable[[Path], dict[str, Any]]:
    def run(d: Path) -> dict[str, Any]:
        from tests.zoo import tv_schemas  # noqa: F401  (before timm/transformers)
        from tests.zoo.harness import export

        built = _zoo_case(model, layout).build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export(built, exporter, d / "model.onnx")
        x = built.example.numpy()
        x = x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x
        np.save(d / "inputs.npy", x[None], allow_pickle=False)
        return {"labels": [], "source": f"tests.zoo.cases {model} {layout} {exporter}"}
    return run


_ZOO_LOWER: dict[tuple[str, str], float | None] = {}


def _zoo_lower(model: str, layout: str) -> Callable[[str], float | None]:
    """The zoo's float64 lower bound on the global constant (tests/zoo/harness.lower_bound:
    a short Jacobian ascent on the continuous map), per model and norm, computed once."""
    def lower(norm: str) -> float | None:
        key = (model, norm)
        if key not in _ZOO_LOWER:
            from tests.jacobians import jacobian_norm, max_jacobian_norm
            from tests.zoo import tv_schemas  # noqa: F401
            from tests.zoo.harness import lower_bound

            try:
                built = _zoo_case(model, layout).build()
                if norm == "2":
                    _ZOO_LOWER[key] = lower_bound(built)
                else:
                    import copy
                    f64 = copy.deepcopy(built.continuous).to(torch.float64).eval()
                    gen = torch.Generator().manual_seed(0)
                    x = torch.randn(*built.continuous_shape, generator=gen,
                                    dtype=torch.float64)
                    try:
                        _ZOO_LOWER[key] = max_jacobian_norm(f64, x, "inf", steps=2)
                    except (NotImplementedError, RuntimeError):
                        # no forward-mode AD for an op (the ascent's jvp): the start's norm
                        _ZOO_LOWER[key] = jacobian_norm(f64, x, "inf")
            except (NotImplementedError, RuntimeError):
                _ZOO_LOWER[key] = None  # no forward-mode AD for an op: no lower bound
        return _ZOO_LOWER[key]
    return lower


def zoo() -> list[Case]:
    from tests.zoo.cases import CASES

    out = []
    for c in CASES:
        lower = _zoo_lower(c.model, c.layout) if c.expected == "certified" else None
        for e in c.exporters:
            out.append(Case(f"zoo/{c.model}[{c.layout}]-{e}", "zoo",
                            _export_zoo(c.model, c.layout, e), lower=lower))
    return out


def zoo_local() -> list[Case]:
    return [Case(f"zoo-local/{m}[{lay}]-{e}", "zoo-local", _export_zoo(m, lay, e), local=True)
            for m, lay, e in ZOO_LOCAL]


# ---- trained ------------------------------------------------------------------------------


def _trained_dir(name: str) -> Path | None:
    return next((p for p in TRAINED if (p / f"{name}.onnx").is_file()), None)


def _export_trained(name: str) -> Callable[[Path], dict[str, Any]]:
    def run(d: Path) -> dict[str, Any]:
        from bench.robustness_zoo import _Loaded
        from bench.trained.models import digits
        from lsa_models.onnx import load_onnx
        from service.bounds.local import model_input

        src = _trained_dir(name)
        if src is None:
            raise FileNotFoundError(f"{name}.onnx: run bench/trained/train.py --out "
                                    f"{TRAINED[0]} first")
        onnx = (src / f"{name}.onnx").read_bytes()
        (d / "model.onnx").write_bytes(onnx)
        om = load_onnx(onnx, "model.onnx")
        _, _, x_te, y_te = digits()
        f64 = om.module.with_dtype(torch.float64)
        xs, ys = [], []
        for img, y in zip(x_te, y_te, strict=True):
            x = model_input(_Loaded(om), img[None].numpy().astype(np.float64))
            if _predicted(f64, x[None])[0] == int(y):
                xs.append(x)
                ys.append(int(y))
            if len(xs) == SET_SIZE:
                break
        return _classifier_meta(d, onnx, np.stack(xs), ys,
                                source=f"{src / name}.onnx, digits test images")
    return run


def _trained(names: tuple[str, ...]) -> list[Case]:
    return [Case(f"trained/{n}", "trained", _export_trained(n), local=True,
                 radius=n in RADIUS_TRAINED, set=n in RADIUS_TRAINED) for n in names
            if _trained_dir(n) is not None or (MODELS / f"trained_{n}").is_dir()]


GROUPS: dict[str, Callable[[], list[Case]]] = {
    "classifiers": classifiers, "zoo": zoo, "zoo-local": zoo_local,
    "trained": lambda: _trained(TRAINED_NAMES), "trained-vit": lambda: _trained(TRAINED_VITS)}
DEFAULT_GROUPS = ("classifiers", "zoo", "zoo-local", "trained")


def corpus(groups: tuple[str, ...] = DEFAULT_GROUPS) -> list[Case]:
    """Every case of the named groups, in a fixed order."""
    return [c for g in groups for c in GROUPS[g]()]
