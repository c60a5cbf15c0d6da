"""The timeline probe (tools/probes/timeline.cu) builds against the extension's kernel headers with their timeline marks
compiled in (trace_ext/timeline.cuh is empty in the extension, so its own build does not compile the marks).

Protects: a change to a kernel header or to the marks that breaks the probe shows up here, on the CPU machine of CI
(nvcc + a CUDA build of torch), not first on the GPU. The built library exports the launchers timeline.py calls, and its
record width is the one timeline.py reads. Skipped only where the extension itself cannot be built (no nvcc, or a
torch without CUDA).
Run: pytest tests/test_probe_build.py -q   (~1 min: one nvcc compile)
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LAUNCHERS = ("timeline_slots", "timeline_set_records", "timeline_marker", "launch_quant_lean3", "launch_kv_heads8")


@pytest.mark.skipif(shutil.which("nvcc") is None or torch.version.cuda is None,
                    reason="needs nvcc and a CUDA build of torch (as the extension's build does)")
def test_timeline_probe_builds(tmp_path):
    so = tmp_path / "timeline.so"
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run([os.path.join(ROOT, "tools", "probes", "build_timeline.sh"), str(so)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    for name in LAUNCHERS:
        assert hasattr(lib, name), name
    sys.path.insert(0, os.path.join(ROOT, "tools", "probes"))
    try:
        import timeline  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    assert lib.timeline_slots() == timeline.SLOTS
