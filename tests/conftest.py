"""What every test starts from.

One compute thread in the test process too, as in every worker it starts: a reference
gradient summed by two threads rounds differently from a stage's one-thread sum, and the
suite must give the same answer whether or not OMP_NUM_THREADS=1 is set.

Each test also starts (and leaves) like a fresh script: no conveyor context left by the
test before it (``conveyor.init`` / ``current`` make a new one), and torch and ``random``
seeded with 0.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from tests.support.helpers import reset_context

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    reset_context()
    torch.manual_seed(0)
    random.seed(0)
    yield
    reset_context()
