"""Training progress: a bar only on a terminal, a log line every few steps, and no bubble
reported as measured where one process runs every stage."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from conveyor.observe.progress import Progress


def _pipe(distributed: bool, rank: int = 0) -> SimpleNamespace:
    context = SimpleNamespace(rank=rank, distributed=distributed)
    return SimpleNamespace(context=context, measured_bubble=lambda: 0.25)


def _run(progress: Progress, steps: int) -> None:
    for _ in range(steps):
        progress.step(2.0, 8)
    progress.close()


def test_in_a_log_one_line_every_n_steps_and_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(_pipe(distributed=True), total=30)  # type: ignore[arg-type]
    assert progress.bar.disable  # stderr is not a terminal under pytest
    _run(progress, 30)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    # By default a line every tenth of the run, and one after the first step.
    assert [int(line.split()[1]) for line in lines] == [1, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    assert all(line.startswith("step") and line.endswith("bubble 0.25") for line in lines)
    assert err == ""


def test_a_bar_only_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress = Progress(_pipe(distributed=True), total=20, every=10)  # type: ignore[arg-type]
    assert not progress.bar.disable
    _run(progress, 20)
    out, err = capsys.readouterr()
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step")] == [
        "1",
        "10",
        "20",
    ]
    assert "20/20" in err  # the bar
    other = Progress(_pipe(distributed=True, rank=1), total=5)  # type: ignore[arg-type]
    assert other.bar.disable  # only rank 0 shows anything
    _run(other, 5)
    assert capsys.readouterr() == ("", "")


def test_one_process_reports_no_measured_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(_pipe(distributed=False), total=4, every=2)  # type: ignore[arg-type]
    _run(progress, 4)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith(
        "samples/s  (one process runs the stages one after another: no bubble to measure)"
    )
    assert not any("bubble 0" in line for line in lines)
    assert lines[2].startswith("step     4  loss 2.0000") and lines[2].endswith("samples/s")
