"""A transfer's words, made only for its error, still name it, its peer and this rank."""

from __future__ import annotations

import datetime

import pytest
import torch

from conveyor.errors import PipelineError
from conveyor.runtime.transport import Op, Transport


class _Late:
    """A work that never finishes (its bounded wait reports a time-out)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return False

    def is_completed(self) -> bool:
        return False


class _Broken(_Late):
    """A work whose wait fails (a peer closed the connection)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        raise RuntimeError("Connection closed by peer")


def _transport() -> Transport:
    # Pipeline rank 1 of replica 1 over 2 pipeline ranks: global rank = 2 + pipeline rank.
    return Transport(1, lambda r: 2 + r, torch.device("cpu"), 0.5)


def test_a_late_receive_is_named_when_its_words_are_a_call() -> None:
    asked = []

    def what() -> str:
        asked.append(1)
        return "F(stage 1, micro-batch 3) waiting for activations of F(stage 0, micro-batch 3)"

    transport = _transport()
    with pytest.raises(PipelineError) as error:
        transport.wait(_Late(), 0, what)  # type: ignore[arg-type]
    assert str(error.value).startswith(
        "rank 3 (pipeline rank 1): F(stage 1, micro-batch 3) waiting for activations of "
        "F(stage 0, micro-batch 3) from rank 2 (pipeline rank 0) did not finish within 0.5 s; "
        "rank 2 (pipeline rank 0) may have died or stalled"
    )
    assert asked == [1]


def test_a_failed_receive_is_named_when_its_words_are_a_string() -> None:
    transport = _transport()
    with pytest.raises(PipelineError) as error:
        transport.wait(_Broken(), 0, "waiting for the step's loss (the last stage)")  # type: ignore[arg-type]
    assert str(error.value).startswith(
        "rank 3 (pipeline rank 1): waiting for the step's loss (the last stage) from rank 2 "
        "(pipeline rank 0) failed (RuntimeError: Connection closed by peer)"
    )
    assert Op(True, torch.zeros(1), 0).what == ""  # no words unless given
