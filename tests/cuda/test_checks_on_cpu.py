"""The CUDA tests' bodies (``checks.py``) on the CPU, where every machine can run them:
their logic and tolerances are exercised even where no GPU is, with the same device
parameter the CUDA tests pass. Compiled stages use ``aot_eager`` here (inductor's C++ builds
take tens of seconds on two cores; tests/runtime/test_compile.py runs inductor itself)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cuda import checks

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # over 2 s: the fast lane stays under 90 s
def test_exact_and_autocast_on_cpu() -> None:
    for name, chunks in checks.FAMILIES:
        checks.exact(CPU, name, chunks)
    checks.autocast(CPU, "zbv", 2)


@pytest.mark.slow  # over 2 s: the fast lane stays under 90 s
def test_step_memory_on_cpu() -> None:
    peaks = {}
    for name, chunks in checks.FAMILIES:
        measured = checks.step_memory(CPU, name, chunks)
        peaks[name] = measured.step_peak
    assert peaks["gpipe"] > 1.5 * peaks["1f1b"], peaks


@pytest.mark.slow
def test_compiled_on_cpu() -> None:
    assert checks.compiled(CPU, "zb-h1", 1, {"backend": "aot_eager"}) > 0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip where CUDA is absent")
def test_cuda_tests_skip_cleanly_without_cuda() -> None:
    """``pytest -m cuda tests/cuda`` on a machine without CUDA: every test skipped, none
    run, none failing, exit status 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda",
         "tests/cuda"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    skipped = re.search(r"(\d+) skipped", out)
    assert skipped and int(skipped.group(1)) >= 20, out
    assert not re.search(r"\d+ (passed|failed|error)", out), out
    assert "needs CUDA" in out
