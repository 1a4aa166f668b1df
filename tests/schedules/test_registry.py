"""Schedule names and their chunk counts: a schedule named for chunks gets them by default."""

from __future__ import annotations

import pytest
from torch import nn
from torch.nn import functional as F

import conveyor
from conveyor.errors import ConfigError
from conveyor.schedules import (
    SCHEDULE_NAMES,
    check_chunks,
    default_chunks,
    get_schedule,
    gpipe,
    interleaved_1f1b,
)

TWO = {"interleaved-1f1b", "looped-bfs", "zbv", "dualpipev", "v-half", "v-min"}


def test_default_chunks_of_every_name() -> None:
    assert {name: default_chunks(name) for name in SCHEDULE_NAMES} == {
        name: 2 if name in TWO else 1 for name in SCHEDULE_NAMES
    }
    with pytest.raises(ConfigError, match="unknown schedule '2f2b'; choose one of 'gpipe'"):
        default_chunks("2f2b")


def test_interleaved_and_looped_without_chunks_run_two() -> None:
    interleaved = get_schedule("interleaved-1f1b", 4, 8)
    assert interleaved.chunks == 2 and interleaved == interleaved_1f1b(4, 8, 2)
    looped = get_schedule("looped-bfs", 3, 5)
    assert looped.chunks == 2 and looped.actions == gpipe(3, 5, 2).actions
    assert get_schedule("zbv", 4, 8).chunks == get_schedule("dualpipev", 4, 8).chunks == 2
    assert get_schedule("1f1b", 4, 8).chunks == 1
    assert get_schedule("interleaved-1f1b", 4, 8, 3).chunks == 3


def test_one_chunk_of_an_interleaved_schedule_is_refused_by_every_caller() -> None:
    """``get_schedule``, ``Pipeline`` and ``conveyor simulate`` share one rule: one chunk
    would silently be plain 1F1B / GPipe."""
    python = (
        "schedule 'interleaved-1f1b' interleaves several chunks per rank; pass chunks=2 "
        "(or more), or use '1f1b' for one"
    )
    with pytest.raises(ConfigError) as got:
        get_schedule("interleaved-1f1b", 4, 8, 1)
    assert str(got.value) == python
    with pytest.raises(ConfigError) as got:
        conveyor.Pipeline(
            nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]), loss_fn=F.mse_loss,
            microbatches=8, schedule="interleaved-1f1b", chunks=1, context=conveyor.init(pp=2),
        )  # fmt: skip
    assert str(got.value) == python
    with pytest.raises(ConfigError) as got:
        check_chunks("looped-bfs", 1, flags=True)
    assert str(got.value) == (
        "--schedule looped-bfs interleaves several chunks per rank; pass --chunks 2 "
        "(or more), or use --schedule gpipe for one"
    )


def test_a_count_the_schedule_cannot_run_is_one_sentence_in_either_spelling() -> None:
    with pytest.raises(ConfigError) as python:
        get_schedule("zbv", 4, 8, 1)
    assert str(python.value) == (
        "schedule 'zbv' runs 2 chunk(s) per rank, got chunks=1; pass chunks=2 (rank r holds "
        "stages r and 2*ranks-1-r)"
    )
    with pytest.raises(ConfigError) as flags:
        check_chunks("zb-h1", 2, flags=True)
    assert str(flags.value) == (
        "--schedule zb-h1 runs 1 chunk(s) per rank, got --chunks 2; use --schedule zbv or "
        "--schedule dualpipev for two chunks per rank"
    )
    with pytest.raises(ConfigError, match="chunks must be an integer >= 1, got 0"):
        get_schedule("interleaved-1f1b", 4, 8, 0)
    assert check_chunks("gpipe", None) == 1 and check_chunks("gpipe", 5) == 5
