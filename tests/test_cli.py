"""The ``conveyor`` command: simulate, errors, and forwarding to demo / launch."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from conveyor.cli import main
from tests.test_simulate import DESIGN_EXAMPLE

SIMULATE = ["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8"]


def test_simulate_json_matches_design(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIMULATE, "--cost", "1,1,1", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == DESIGN_EXAMPLE
    assert out.count("\n") == 1


def test_simulate_json_interleaved_with_comm(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--schedule", "interleaved-1f1b", "--ranks", "4", "--microbatches", "8"]
    assert main([*argv, "--chunks", "2", "--cost", "1,2,0", "--comm", "0.5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["chunks"], data["cost"], data["comm"]) == (2, [1.0, 2.0, 0.0], 0.5)
    assert data["makespan"] > 8 * 3 + 3 * 3 / 2  # the comm-free closed form
    assert data["peak_activations"] == [5.5, 4.5, 3.5, 2.5]


def test_simulate_prints_summary_and_timeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SIMULATE) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("schedule 1f1b: 4 ranks x 1 chunk(s), 8 micro-batches")
    assert lines[1].startswith("makespan 33  span 33  bubble 27.27%")
    assert lines[1].endswith("peak activations per rank 4, 3, 2, 1")
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 4
    assert rows[0].startswith("rank  0 |F0 F1 F2 F3 ...")
    assert rows[3].startswith("rank  3 |.........F0 B0")


def test_simulate_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    assert main([*SIMULATE, "--png", str(path), "--json"]) == 0
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert json.loads(capsys.readouterr().out)["makespan"] == 33.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["simulate", "--schedule", "2f2b", "--ranks", "4", "--microbatches", "8"],
            "unknown schedule '2f2b'; choose one of 'gpipe', '1f1b', 'interleaved-1f1b'",
        ),
        ([*SIMULATE[:4], "0", *SIMULATE[5:]], "ranks must be an integer >= 1, got 0"),
        ([*SIMULATE, "--cost", "1,2"], "--cost must be three numbers >= 0 as F,B,W"),
        ([*SIMULATE, "--cost", "1,x,2"], "--cost must be three numbers >= 0 as F,B,W"),
        ([*SIMULATE, "--cost", "1,-2,2"], "--cost must be three numbers >= 0 as F,B,W"),
        ([*SIMULATE, "--chunks", "2"], "use 'interleaved-1f1b'"),
        ([*SIMULATE, "--comm", "-1"], "comm must be a finite number >= 0"),
        ([*SIMULATE[:4], "four", *SIMULATE[5:]], "argument --ranks: invalid int value: 'four'"),
        (SIMULATE[:3], "the following arguments are required: --ranks, --microbatches"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_input_exits_2_with_one_sentence(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert captured.err.count("\n") == 1


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "simulate" in out and "demo" in out and "launch" in out


@pytest.mark.parametrize("command", ["demo", "launch"])
def test_demo_and_launch_get_their_arguments_untouched(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        received.append(argv)
        return 3

    module = types.ModuleType(f"conveyor.{command}")
    module.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"conveyor.{command}", module)
    argv = ["--nproc", "2", "train.py", "--lr", "0.1", "--help"]
    assert main([command, *argv]) == 3
    assert received == [argv]
