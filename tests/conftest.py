"""Shared pytest set-up: the hypothesis CI profile and skipping of GPU-only tests."""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI runs on a 2-core CPU under pytest-xdist: no per-example deadline, fewer examples.
settings.register_profile(
    "ci", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", deadline=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)
