"""The CUDA tests' bodies (``checks.py``) on the CPU, where every machine can run them:
their logic and tolerances are exercised even where no GPU is, with the same device
parameter the CUDA tests pass. Compiled stages use ``aot_eager`` here (inductor's C++ builds
take tens of seconds on two cores; tests/runtime/test_compile.py runs inductor itself)."""

from __future__ import annotations

import pytest
import torch

from tests.cuda import checks

CPU = torch.device("cpu")


def test_exact_and_autocast_on_cpu() -> None:
    for name, chunks in checks.FAMILIES:
        checks.exact(CPU, name, chunks)
    checks.autocast(CPU, "zbv", 2)


def test_step_memory_on_cpu() -> None:
    peaks = {}
    for name, chunks in checks.FAMILIES:
        measured = checks.step_memory(CPU, name, chunks)
        peaks[name] = measured.step_peak
    assert peaks["gpipe"] > 1.5 * peaks["1f1b"], peaks


@pytest.mark.slow
def test_compiled_on_cpu() -> None:
    assert checks.compiled(CPU, "zb-h1", 1, {"backend": "aot_eager"}) > 0
