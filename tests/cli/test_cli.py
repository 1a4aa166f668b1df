"""The ``conveyor`` command: simulate, errors, and forwarding to demo / launch."""

from __future__ import annotations

import importlib
import json
import re
import sys
import types
from argparse import ArgumentParser
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import conveyor
from conveyor.cli.command import main
from conveyor.schedules import SCHEDULE_NAMES, default_chunks
from tests.schedules.test_simulate import DESIGN_EXAMPLE

ROOT = Path(__file__).resolve().parents[2]
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


def test_simulate_prints_summary_and_timeline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # the timeline's width follows the terminal's
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
        ([*SIMULATE[:4], "0", *SIMULATE[5:]], "--ranks must be an integer >= 1, got 0"),
        ([*SIMULATE, "--chunks", "0"], "--chunks must be an integer >= 1, got 0"),
        ([*SIMULATE, "--cost", "1,2"], "--cost must be three numbers >= 0 as F,B,W"),
        ([*SIMULATE, "--cost", "1,x,2"], "--cost must be three numbers >= 0 as F,B,W"),
        ([*SIMULATE, "--cost", "1,-2,2"], "--cost must be three numbers >= 0 as F,B,W"),
        (
            [*SIMULATE, "--chunks", "2"],
            "--schedule 1f1b runs 1 chunk(s) per rank, got --chunks 2; "
            "use --schedule interleaved-1f1b for several chunks per rank",
        ),
        (
            [
                "simulate",
                "--schedule",
                "zbv",
                "--ranks",
                "4",
                "--microbatches",
                "8",
                "--chunks",
                "1",
            ],
            "--schedule zbv runs 2 chunk(s) per rank, got --chunks 1; pass --chunks 2",
        ),
        (
            [
                "simulate",
                "--schedule",
                "interleaved-1f1b",
                "--ranks",
                "4",
                "--microbatches",
                "8",
                "--chunks",
                "1",
            ],
            "--schedule interleaved-1f1b interleaves several chunks per rank; pass --chunks 2 "
            "(or more), or use --schedule 1f1b for one",
        ),
        ([*SIMULATE, "--comm", "-1"], "--comm must be a finite number >= 0, got -1"),
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
    assert "chunks=" not in captured.err and "comm must" not in captured.err.replace("--comm", "")


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
    monkeypatch.setitem(sys.modules, f"conveyor.cli.{command}", module)
    argv = ["--nproc", "2", "train.py", "--lr", "0.1", "--help"]
    assert main([command, *argv]) == 3
    assert received == [argv]


# --- the schedule's own chunk count ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "chunks"), [(name, default_chunks(name)) for name in SCHEDULE_NAMES]
)
def test_simulate_without_chunks_takes_the_schedules_own(
    name: str, chunks: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--schedule", name, "--ranks", "4", "--microbatches", "8", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chunks"] == chunks
    assert len(data["peak_activations"]) == 4


# --- one line for a bad file or path -------------------------------------------------------


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_simulate_png_into_a_missing_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "missing" / "t.png"
    assert main([*SIMULATE, "--png", str(png)]) == 2
    assert _one_error_line(capsys) == (
        f"conveyor simulate: error: cannot write {png}: folder {png.parent} does not exist; "
        "create it or pick another path"
    )


def test_trace_of_a_missing_or_foreign_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = str(tmp_path / "t.png")
    missing = str(tmp_path / "none.json")
    assert main(["trace", missing, "--png", png]) == 2
    assert _one_error_line(capsys) == (
        f"conveyor trace: error: no file {missing}; pass a trace written by pipe.save_trace(path)"
    )
    for text in ("not json", '{"traceEvents": [{"cat": "F", "tid": 0}]}', "[1, 2]"):
        foreign = tmp_path / "foreign.json"
        foreign.write_text(text)
        assert main(["trace", str(foreign), "--png", png]) == 2
        assert _one_error_line(capsys).startswith(
            f"conveyor trace: error: {foreign} is not a trace written by pipe.save_trace(path)"
        )
    assert not Path(png).exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, "no file {path}; pass a Python file that defines build()"),
        ("def build(:\n", "{path} line 1: invalid syntax; it must be Python that defines build()"),
        (
            "raise ValueError('no data here')\n",
            "running {path} raised ValueError: no data here; run 'python {path}' to see where",
        ),
        (
            "x = 1\n",
            "{path} has no build(); define build() returning (model, inputs, targets, loss_fn)",
        ),
        ("def build():\n    return 1\n", "{path}: build() returned int; define build()"),
        (
            "def build():\n    return {}['model']\n",
            "{path}: build() raised KeyError: 'model'; call it in Python to see where",
        ),
    ],
)
def test_plan_with_a_bad_file(
    source: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.py"
    if source is not None:
        path.write_text(source)
    assert main(["plan", str(path)]) == 2  # bad input, as in every conveyor command
    assert _one_error_line(capsys).startswith("conveyor plan: error: " + message.format(path=path))


def test_plan_names_its_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tmp_path / "m.py"), "--ranks", "0"]) == 2
    assert "error: --ranks must be an integer >= 1, got 0" in _one_error_line(capsys)
    assert main(["plan", str(tmp_path / "m.py"), "--memory-limit", "-5"]) == 2
    assert "error: --memory-limit must be a number of bytes > 0, got -5" in _one_error_line(capsys)


# --- --version and --help ------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"conveyor {conveyor.__version__}\n"


def test_launch_help_says_what_conveyor_adds_before_torchruns_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: conveyor launch [OPTIONS] (SCRIPT | -m MODULE) [ARGS ...]")
    added = [
        out.index(word)
        for word in (
            "OMP_NUM_THREADS=1",
            "MALLOC_MMAP_THRESHOLD_",
            "c10d rendezvous",
            "--max-restarts",
        )
    ]
    assert max(added) < out.index("--nproc-per-node NPROC_PER_NODE")
    assert "torchrun restarts after any" in out


class _Parsed(Exception):
    """Carries the parser a command built, instead of parsing."""


def _parser_of(
    run: Callable[[], object], monkeypatch: pytest.MonkeyPatch, prog: str | None = None
) -> ArgumentParser:
    """The parser that ``run`` parses its arguments with (the one named ``prog``, for a
    sub-command's: the parsers before it parse as usual)."""
    parse = ArgumentParser.parse_known_args

    def grab(self: ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        if prog is None or self.prog == prog:
            raise _Parsed(self)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(ArgumentParser, "parse_known_args", grab)
    with pytest.raises(_Parsed) as parsed:
        run()
    monkeypatch.undo()
    parser = parsed.value.args[0]
    assert isinstance(parser, ArgumentParser)
    return parser


def _example(name: str, argv: list[str]) -> Callable[[], object]:
    def run() -> object:
        sys.path.insert(0, str(ROOT / "examples"))
        try:
            module = importlib.import_module(name)
        finally:
            sys.path.remove(str(ROOT / "examples"))
        return module.main(argv)

    return run


def _entries(text: str) -> dict[str, str]:
    """The options and positionals a ``--help`` text lists: each one's names as printed
    (``-n N, --steps N``) -> its help, in one line."""
    entries: dict[str, str] = {}
    names = ""
    sections = re.split(r"\n(?=\S[^\n]*:\n)", text)
    for section in sections:
        if not section.startswith(("options:", "positional arguments:")):
            continue
        for line in section.splitlines()[1:]:
            if re.match(r"  \S", line):  # a new entry: its names, then maybe its help
                names, _, first = line.strip().partition("  ")
                entries[names] = first.strip()
            elif line.strip() and names:
                entries[names] = (entries[names] + " " + line.strip()).strip()
    return entries


def _dest(names: str) -> str:
    """argparse's dest of an option: its first long name (else its first), as a name."""
    flags = [word.split()[0] for word in names.split(", ")]
    long = [f for f in flags if f.startswith("--")]
    return (long or flags)[0].lstrip("-").replace("-", "_")


@pytest.mark.parametrize(
    "command",
    ["simulate", "demo", "plan", "trace", "examples/gpt.py", "examples/resnet.py"],
)
def test_every_option_has_help_with_its_default(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``--help`` prints: every option has help, and one with a default says it."""
    if command.startswith("examples/"):
        with pytest.raises(SystemExit) as done:
            _example(Path(command).stem, ["--help"])()
        assert done.value.code == 0
        parser = _parser_of(_example(Path(command).stem, []), monkeypatch)
    else:
        assert main([command, "--help"]) == 0
        argv = [command, "x.py", "--png", "x.png"]
        if command == "simulate":
            argv = SIMULATE
        parser = _parser_of(lambda: main(argv), monkeypatch, f"conveyor {command}")
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and ":mod:" not in text
    entries = _entries(text)
    assert len(entries) > 1, text
    for names, shown in entries.items():
        if names.startswith(("-h, --help", "--help")):
            continue
        assert shown, f"{command}: {names} has no help"
        if names.startswith("-") and parser.get_default(_dest(names)) not in (None, False):
            assert "default" in shown, f"{command}: {names} does not show its default"
