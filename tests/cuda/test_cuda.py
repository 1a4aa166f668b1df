"""A one-process pipeline on CUDA (every pipeline rank's stages on the one GPU): each
schedule family exact against the unsplit model, compiled stages through inductor, bf16
autocast, and each schedule's peak CUDA memory against the simulator's peak activations.

Marked ``cuda``: skipped where ``torch.cuda.is_available()`` is false (tests/conftest.py).
Run with ``python -m pytest -q -m cuda tests/cuda``. The bodies are in ``checks.py``, which
``test_checks_on_cpu.py`` also runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda import checks
from tests.cuda.checks import FAMILIES

pytestmark = pytest.mark.cuda

NAMES = [name for name, _ in FAMILIES]


def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize(("name", "chunks"), FAMILIES, ids=NAMES)
def test_every_family_is_exact_on_cuda(name: str, chunks: int) -> None:
    checks.exact(cuda(), name, chunks)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("zbv", 2)])
def test_inductor_stages_match_the_eager_model(name: str, chunks: int) -> None:
    """inductor (``compile={"backend": "inductor"}``, the default), on a fused and on the
    split backward, one and two chunks: two batch sizes, so a recompile is exercised too."""
    assert checks.compiled(cuda(), name, chunks, {"backend": "inductor"}) > 0


@pytest.mark.parametrize(("name", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("zbv", 2)])
def test_bf16_autocast_matches_the_unsplit_model_under_autocast(name: str, chunks: int) -> None:
    checks.autocast(cuda(), name, chunks)


@pytest.mark.parametrize(("name", "chunks"), FAMILIES, ids=NAMES)
def test_peak_memory_is_the_schedules(name: str, chunks: int) -> None:
    checks.step_memory(cuda(), name, chunks)


def test_gpipe_holds_more_than_1f1b() -> None:
    """The simulator's ordering shows on the device: GPipe holds every micro-batch."""
    held = {n: checks.step_memory(cuda(), n, 1).step_peak for n in ("gpipe", "1f1b")}
    assert held["gpipe"] > 1.5 * held["1f1b"], held
