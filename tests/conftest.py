"""Shared test setup: seeds, and the `gpu` marker (skipped with a reason when no usable CUDA kernels)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "python") not in sys.path and not os.environ.get("TRACE_EXT_TEST_INSTALLED"):
    pass  # tests import the installed package (make test installs it); nothing to patch

import trace_ext  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled kernels (run on the H200)")
    config.addinivalue_line("markers", "slow: long CPU test")


def _gpu_skip_reason():
    b = trace_ext.backends()
    if not b["cuda_available"]:
        return "no CUDA device: GPU tests run on the H200 (make gpu)"
    if not b["kernels_usable"]:
        return f"compiled kernels unusable here: {b['kernels_unusable_reason']}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_each_test():
    torch.manual_seed(0)
    yield
