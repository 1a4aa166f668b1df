"""The schedule registry: every name gives its generator's schedule, unknown names and bad
sizes are one sentence, and a schedule named for chunks gets them by default (one chunk of
an interleaved or V schedule, or two of a one-chunk one, is refused in either spelling)."""

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
    one_f_one_b,
    zb_h1,
    zbv,
)

TWO = {"interleaved-1f1b", "looped-bfs", "zbv", "dualpipev", "v-half", "v-min"}
ZERO_BUBBLE = ("looped-bfs", "zb-h1", "zb-h2", "zb-late", "zbv", "dualpipev", "zb-auto")
V = ("zbv", "dualpipev", "v-half", "v-min")  # two chunks per rank, in a V


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


# --- names ---------------------------------------------------------------------------------


def test_every_name_gives_its_generators_schedule() -> None:
    assert SCHEDULE_NAMES[:3] == ("gpipe", "1f1b", "interleaved-1f1b")
    assert set(ZERO_BUBBLE) <= set(SCHEDULE_NAMES)
    assert get_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert get_schedule("interleaved-1f1b", 2, 5, 3) == interleaved_1f1b(2, 5, 3)
    assert get_schedule("gpipe", 3, 2, 2) == gpipe(3, 2, 2)
    assert get_schedule("zb-h1", 3, 5) == zb_h1(3, 5)
    assert get_schedule("zbv", 3, 5, 2) == zbv(3, 5)
    assert get_schedule("looped-bfs", 3, 5, 3).actions == gpipe(3, 5, 3).actions


def test_unknown_schedule_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as error:
        get_schedule("2f2b", 4, 8)
    message = str(error.value)
    assert "'2f2b'" in message
    assert all(repr(name) in message for name in SCHEDULE_NAMES)


@pytest.mark.parametrize(
    ("ranks_", "microbatches_", "chunks_", "word"),
    [(0, 8, 1, "ranks"), (4, 0, 1, "microbatches"), (4, 8, 0, "chunks"), (True, 8, 1, "ranks")],
)
def test_sizes_below_one_are_rejected(
    ranks_: int, microbatches_: int, chunks_: int, word: str
) -> None:
    with pytest.raises(ConfigError, match=rf"{word} must be an integer >= 1"):
        get_schedule("gpipe", ranks_, microbatches_, chunks_)


# --- chunks of the one-chunk and the V schedules --------------------------------------------


def test_1f1b_with_chunks_points_to_interleaved() -> None:
    with pytest.raises(ConfigError, match=r"chunks=2.*use 'interleaved-1f1b'"):
        get_schedule("1f1b", 4, 8, chunks=2)


@pytest.mark.parametrize("name", V)
def test_v_schedules_are_registered_with_two_chunks_and_ask_for_them(name: str) -> None:
    assert name in SCHEDULE_NAMES
    assert default_chunks(name) == 2
    assert get_schedule(name, 4, 8).chunks == 2
    with pytest.raises(
        ConfigError, match=rf"'{name}' runs 2 chunk\(s\) per rank, got chunks=1; pass chunks=2"
    ):
        get_schedule(name, 4, 8, 1)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_one_chunk_zero_bubble_schedules_point_to_the_v_ones(name: str) -> None:
    with pytest.raises(ConfigError, match=r"got chunks=2; use 'zbv' or 'dualpipev'"):
        get_schedule(name, 4, 8, chunks=2)


def test_zb_auto_builds_one_chunk_or_a_v_and_refuses_more() -> None:
    assert default_chunks("zb-auto") == 1
    assert get_schedule("zb-auto", 4, 8).placement == (0, 1, 2, 3)
    assert get_schedule("zb-auto", 4, 8, chunks=2).placement == (0, 1, 2, 3, 3, 2, 1, 0)
    with pytest.raises(
        ConfigError,
        match=r"'zb-auto' runs 1 or 2 chunk\(s\) per rank, got chunks=3; use "
        r"'interleaved-1f1b' for more chunks per rank",
    ):
        get_schedule("zb-auto", 4, 8, chunks=3)
