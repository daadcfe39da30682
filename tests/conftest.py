"""Shared test setup: one torch thread (2 cores contend badly), hypothesis profiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Before any test imports transformers or timm: they import the registry's torchvision, whose C
# ops do not load against CPU torch (tests/zoo/tv_schemas.py says why this is enough).
from tests.zoo import tv_schemas  # noqa: F401

torch.set_num_threads(1)

# CI runs at least 500 examples per bound kind; LSA_SLOW=1 runs 10^4.
settings.register_profile(
    "ci", max_examples=500, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "slow", max_examples=10_000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("slow" if os.environ.get("LSA_SLOW") == "1" else "ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_slow = pytest.mark.skip(reason="slow: set LSA_SLOW=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("LSA_SLOW") != "1":
            item.add_marker(skip_slow)
