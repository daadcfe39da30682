"""Bounds around one input, shared by the CLI (`lsa bound --at`, `lsa robustness`, `lsa verify
--recompute --at`) and the service (`POST /bound` with `at`/`eps`; the robustness jobs of
`POST /certify`): the local (ball) report of a loaded model, so both print the same object;
and `model_input`, the one conversion of a user's input (a pixel upload's image) to what the
graph takes (the robustness radii and set verdicts built on it: service.robustness.verdicts).

Imports of lsa_models (hence torch) are deferred to the calls: `lsa --help` and the server's
start need none of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from api_schemas import BoundReport
from api_schemas.bounds import BallDomain, Witness
from api_schemas.requests import center_shape

from ..compute import ComputeBusy
from ..db import transaction
from ..errors import InvalidRequest, PayloadTooLarge
from ..models.service import ModelRef
from ..runtime import Runtime
from .service import (
    check_sync_size,
    load_model,
    request_key,
    store_result,
    stored_report_json,
)


def patch_grid(loaded: Any) -> tuple[int, int, int, int, int] | None:
    """(C, H, W, kh, kw) of an upload on pixels (summary layout "pixels"), else None. The
    loader cut the image into patches with Reshape (B, P, C kh kw) -> (B, Hp, Wp, C, kh, kw)
    in front of the graph (lsa_models.onnx.loading._pixels_to_patches): its shape is read
    here, so the image a user sends is cut exactly as the graph puts it back together. A
    graph without that Reshape (none is known) gives None: its input is taken as the
    patches."""
    onnx_model = getattr(loaded, "onnx", None)
    spec = getattr(onnx_model, "spec", None)
    pixels = getattr(spec, "pixels", None)
    if spec is None or pixels is None:
        return None
    import onnx  # deferred: only pixel uploads get here

    c, h, w = (int(v) for v in pixels)
    inits = {t.name: t for t in spec.model.graph.initializer}
    for node in spec.model.graph.node:
        if node.op_type == "Reshape" and node.input[0] == spec.input_name \
                and node.input[1] in inits:
            dims = [int(v) for v in onnx.numpy_helper.to_array(inits[node.input[1]])]
            if len(dims) == 6 and dims[3] == c and dims[1] * dims[4] == h \
                    and dims[2] * dims[5] == w:
                return c, h, w, dims[4], dims[5]
    return None


def model_input(loaded: Any, x0: np.ndarray, field: str = "at") -> np.ndarray:
    """The one conversion of a user's input to what the graph takes: on a pixel upload the
    image (1, C, H, W) or (C, H, W) becomes its patches (1, P, C kh kw) (a permutation of the
    pixels: the same norms, docs/bounds.md "Conv patch embeddings"); any other input is
    returned as is (the engine checks it against the graph's (N, D)). ValueError naming
    `field` and both accepted shapes for an image of the wrong shape."""
    grid = patch_grid(loaded)
    if grid is None:
        return x0
    c, h, w, kh, kw = grid
    if x0.shape not in ((1, c, h, w), (c, h, w)):
        raise ValueError(f"{field}: shape {tuple(x0.shape)}; this model takes an image: give "
                         f"(1, C, H, W) = (1, {c}, {h}, {w}) or (C, H, W) = ({c}, {h}, {w}) "
                         f"(it is analysed as its {(h // kh) * (w // kw)} patches of "
                         f"{c}x{kh}x{kw} pixels)")
    hp, wp = h // kh, w // kw
    grid6 = x0.reshape(1, c, hp, kh, wp, kw)  # (1, C, Hp, kh, Wp, kw)
    patches = grid6.transpose(0, 2, 4, 1, 3, 5)  # (1, Hp, Wp, C, kh, kw)
    return np.ascontiguousarray(patches.reshape(1, hp * wp, c * kh * kw))  # (1, P, C kh kw)


def model_image(loaded: Any, x: np.ndarray) -> np.ndarray:
    """`model_input`'s inverse: a point the graph takes, (1, P, C kh kw) on a pixel upload,
    back in the image layout (1, C, H, W) (the same permutation of the pixels, so the same
    norms); any other input as is. A counterexample is handed back in the layout it was
    asked about."""
    grid = patch_grid(loaded)
    if grid is None:
        return x
    c, h, w, kh, kw = grid
    hp, wp = h // kh, w // kw
    patches = x.reshape(1, hp, wp, c, kh, kw)  # (1, Hp, Wp, C, kh, kw)
    grid6 = patches.transpose(0, 3, 1, 4, 2, 5)  # (1, C, Hp, kh, Wp, kw)
    return np.ascontiguousarray(grid6.reshape(1, c, h, w))  # (1, C, H, W)


def local_report_of(loaded: Any, sha256: str, x0: np.ndarray, eps: float, norm: str, *,
                    empirical: Any = None) -> BoundReport:
    """The bound on the ball {X : ||X - X0||_norm <= eps}; `upper` is the local constant.
    With `empirical` (restarts, steps, seed, time_budget_s attributes), the in-ball
    projected-ascent lower bound too. Raises ValueError for a bad input or eps."""
    from lsa_models.empirical import ratio  # deferred: torch
    from lsa_models.engine.routes.certify import certify_local

    from ..reports import bound_report

    result = certify_local(loaded, x0, eps, norm)  # type: ignore[arg-type]
    report = bound_report(result, sha256)
    layers = [lo.model_copy(update={"rule": lb.rule, "global_upper": lb.global_upper})
              for lo, lb in zip(report.layers, result.layers, strict=True)]
    assert result.domain is not None
    update: dict[str, Any] = {"layers": layers, "domain": BallDomain(**result.domain)}
    if empirical is not None:
        import torch  # deferred: seconds at start-up

        from lsa_models.empirical.local import local_lower_bound
        from lsa_models.engine.drivers.centre import check_center
        from lsa_models.engine.routes.certify import as_onnx

        om = as_onnx(loaded, x0.shape[-2])
        x = check_center(om, x0)
        lb = local_lower_bound(om.module.with_dtype(torch.float64), x, eps, norm,
                               restarts=empirical.restarts, steps=empirical.steps,
                               seed=empirical.seed, time_budget_s=empirical.time_budget_s)
        update.update(lower=lb.lower, ratio=ratio(report.upper, lb.lower), witness=Witness(
            seed=lb.seed, value=lb.lower, input_shape=list(lb.witness.shape),
            input=[float(v) for v in lb.witness.reshape(-1)], restarts=lb.restarts,
            steps=lb.steps, source="search"))
    return report.model_copy(update=update)


def center_array(runtime: Runtime, at: list[Any]) -> np.ndarray:
    """`at` as a float64 array as sent (the request schema checked that it is rectangular
    and finite); 413 past LSA_MAX_AT_ELEMENTS."""
    limit = runtime.settings.max_at_elements
    shape = center_shape(at)
    size = math.prod(shape)
    if size > limit:
        raise PayloadTooLarge(f"at: {size} numbers (shape {shape}), above "
                              f"LSA_MAX_AT_ELEMENTS={limit}: send a smaller input or raise the "
                              "limit")
    return np.asarray(at, dtype=np.float64)


def check_at_shape(model: ModelRef, x0: np.ndarray) -> None:
    """422 unless `x0` is one input of the stored model's (N, D), or (1, N, D) (what the
    engine would say, said before any job is queued)."""
    n, d = model.fixed_seq_len, model.d_model
    ok = (x0.ndim == 2 or (x0.ndim == 3 and x0.shape[0] == 1)) \
        and (d is None or x0.shape[-1] == d) and (n is None or x0.shape[-2] == n)
    if not ok:
        want = f"({'N' if n is None else n}, {'D' if d is None else d})"
        raise InvalidRequest(f"at: the input has shape {tuple(x0.shape)}; the model takes one "
                             f"input of shape {want} (a leading batch dimension of 1 allowed)")


async def model_center(runtime: Runtime, model: ModelRef, at: list[Any]) -> np.ndarray:
    """`at` as the float64 input the graph takes: a pixel upload's image cut into its
    patches (model_input: the model is loaded for its patch grid, on a request thread);
    413 past LSA_MAX_AT_ELEMENTS, 422 naming the accepted shapes."""
    x0 = center_array(runtime, at)
    if model.layout == "pixels":
        loaded = await run_in_threadpool(load_model, runtime, model)
        try:
            x0 = model_input(loaded, x0)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
    check_at_shape(model, x0)
    return x0


def ball_key(model: ModelRef, norm: str, x0: np.ndarray, eps: float,
             empirical: dict[str, Any] | None = None) -> tuple[str, int]:
    """The request key of a local bound (the centre's sha256 and eps in it) and N."""
    from lsa_models.engine.drivers.centre import center_sha256  # deferred: torch

    n = x0.shape[-2]
    ball = {"center_sha256": center_sha256(x0.reshape(1, *x0.shape[-2:])), "eps": float(eps)}
    return request_key(model.sha256, norm, n, None, empirical, ball), n


async def run_counted(runtime: Runtime, key: str, fn: Callable[[], Any]) -> Any:
    """`fn` on the compute pool; a refusal (queue full: 503) is counted like the global
    bound's."""
    try:
        return await runtime.compute.run(key, fn)
    except ComputeBusy:
        if runtime.metrics is not None:
            runtime.metrics.rejected.inc()
        raise


def _bad_at(exc: Exception) -> InvalidRequest:
    return InvalidRequest(f"at: {exc}")


def compute_local_and_store(runtime: Runtime, model: ModelRef, key: str, norm: str,
                            x0: np.ndarray, eps: float) -> BoundReport:
    """Compute the local report (no transaction open meanwhile), then store it once."""
    loaded = load_model(runtime, model)
    try:
        report = local_report_of(loaded, model.sha256, x0, eps, norm)
    except (ValueError, TypeError) as exc:
        raise _bad_at(exc) from None
    with transaction(runtime.sessions) as s:
        row = store_result(s, model, key, report, None)
        stored = BoundReport.model_validate(row.report)
    if runtime.metrics is not None:
        runtime.metrics.bounds.inc()
    return stored


async def local_report_json(runtime: Runtime, model: ModelRef, norm: str, x0: np.ndarray,
                            eps: float) -> bytes:
    """The stored local report of this ball (`x0`: model_center's), or computed on the
    compute pool and stored."""
    key, _ = ball_key(model, norm, x0, eps)
    stored = await run_in_threadpool(stored_report_json, runtime, key)
    if stored is not None:
        return stored
    check_sync_size(runtime, model)
    report = await run_counted(
        runtime, key, lambda: compute_local_and_store(runtime, model, key, norm, x0, eps))
    assert isinstance(report, BoundReport)
    body = report.model_dump_json().encode()
    runtime.reports.put(key, body)
    return body
