"""What every test starts from.

One compute thread in the test process too, as in every worker it starts: a reference
gradient summed by two threads rounds differently from a stage's one-thread sum, and the
suite must give the same answer whether or not OMP_NUM_THREADS=1 is set.

Each test also starts (and leaves) like a fresh script: no conveyor context left by the
test before it (``conveyor.init`` / ``current`` make a new one), and torch and ``random``
seeded with 0.

No tqdm monitor thread: tests fork their workers from this process (tests/support/
distributed.py), and a fork while another thread is inside malloc leaves the child a heap
it cannot use ("malloc(): unaligned tcache chunk detected"); tqdm starts that thread with
the first progress bar (transformers' ``from_pretrained`` shows one) and it wakes every ten
seconds.

Tests marked ``cuda`` are skipped where ``torch.cuda.is_available()`` is false.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import tqdm.std

from tests.support.helpers import reset_context

torch.set_num_threads(1)
tqdm.std.tqdm.monitor_interval = 0  # every tqdm class inherits it: no monitor thread


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``cuda`` tests without a CUDA device (the mark is in pyproject.toml)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    reset_context()
    torch.manual_seed(0)
    random.seed(0)
    yield
    reset_context()
