"""Timelines as pictures and as text: units, a legend for every colour and shade, the chunk
count in the title, micro-batch numbers wherever they fit (V schedules too)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import conveyor.observe.pictures
from conveyor.cli.command import main
from conveyor.errors import ConfigError
from conveyor.observe.pictures import draw_timeline
from conveyor.schedules import get_schedule
from conveyor.simulate import ascii_timeline, simulate

pytest.importorskip("matplotlib")


def _drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the command draws, kept for inspection."""
    figures: list[Any] = []

    def keep(*args: Any, **kwargs: Any) -> Any:
        figures.append(draw_timeline(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(conveyor.observe.pictures, "draw_timeline", keep)
    return figures


def test_simulated_v_schedule_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = _drawn(monkeypatch)
    png = tmp_path / "zbv.png"
    argv = ["simulate", "--schedule", "zbv", "--ranks", "2", "--microbatches", "4"]
    assert main([*argv, "--png", str(png), "--json"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (axes,) = figures[0].axes
    assert axes.get_xlabel() == "time (cost units)"
    assert axes.get_title(loc="left").startswith("zbv: 2 ranks x 2 chunk(s), 4 micro-batches")
    legend = [t.get_text() for t in axes.get_legend().get_texts()]
    assert legend == [
        "F: forward",
        "B: backward, input gradient",
        "W: weight gradient",
        "chunk 0 of each rank",
        "chunk 1 of each rank",
    ]
    # Every box is wide enough here: each of the 2 x 2 x 4 x 3 actions shows its micro-batch.
    labels = sorted(t.get_text() for t in axes.texts)
    assert labels == sorted(str(mb) for mb in range(4) for _ in range(2 * 2 * 3))
    capsys.readouterr()


def test_only_labels_that_fit(tmp_path: Path) -> None:
    # One long action and many short ones: the short ones are too narrow for "10".
    events = [(0, "F", 0, 0, 0.0, 100.0)] + [
        (1, "W", 1, mb, 100.0 + 0.01 * mb, 100.0 + 0.01 * (mb + 1)) for mb in range(12)
    ]
    figure = draw_timeline(events, tmp_path / "t.png", unit="ms")
    (axes,) = figure.axes
    assert [t.get_text() for t in axes.texts] == ["0"]
    assert axes.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in axes.get_legend().get_texts()] == [
        "F: forward",
        "W: weight gradient",
    ]


def test_waits_are_grey_and_named_in_the_legend(tmp_path: Path) -> None:
    events = [
        (0, "F", 0, 0, 0.0, 1.0),
        (1, "wait", 1, 0, 0.0, 1.0),
        (1, "F", 1, 0, 1.0, 2.0),
        (1, "B", 1, 0, 2.0, 3.0),
        (0, "B", 0, 0, 3.0, 4.0),
    ]
    (axes,) = draw_timeline(events, tmp_path / "t.png").axes
    assert [t.get_text() for t in axes.get_legend().get_texts()] == [
        "F: forward",
        "B: backward",
        "waiting for a transfer",
    ]
    assert len(axes.texts) == 4  # the wait is not labelled


def test_a_missing_folder_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"folder .*missing does not exist; create it"):
        draw_timeline([(0, "F", 0, 0, 0.0, 1.0)], tmp_path / "missing" / "t.png")


@pytest.mark.parametrize(("name", "m", "width"), [("zbv", 8, 160), ("dualpipev", 16, 100)])
def test_text_timeline_of_v_schedules_keeps_microbatch_numbers(
    name: str, m: int, width: int
) -> None:
    text = ascii_timeline(simulate(get_schedule(name, 4, m)), width=width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines)
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) % 4 == 0 and len(rows) > 4  # cut into parts, one under the other
    for rank in range(4):
        row = "".join(line.split("|")[1] for line in rows if line.startswith(f"rank  {rank} "))
        labels = re.findall(r"[FBW]\d+[ab]", row)
        # Every action of the rank shows kind, micro-batch and chunk: 2 chunks x F, B, W.
        assert sorted(labels) == sorted(
            f"{k}{mb}{c}" for k in "FBW" for mb in range(m) for c in "ab"
        )
    assert lines[1].startswith("time 0 to ")
