"""``conveyor launch`` (a torchrun front) and ``conveyor demo`` end to end, in subprocesses."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import conveyor.cli.launch
from conveyor.cli import demo
from conveyor.cli.command import main as cli_main
from conveyor.observe.trace import measured_costs

ROOT = Path(__file__).resolve().parents[2]

# One write per line: under torchrun (python -u) print() writes the text and the newline
# separately, so two ranks' lines could interleave on one line.
SCRIPT = """\
import os, sys
import torch
os.write(1, (f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
             f"omp={os.environ.get('OMP_NUM_THREADS')} threads={torch.get_num_threads()} "
             f"mmap={os.environ.get('MALLOC_MMAP_THRESHOLD_')} "
             f"args={sys.argv[1:]}\\n").encode())
if os.environ['RANK'] == os.environ.get('FAIL_RANK'):
    if os.environ.get('FAIL_WITH'):
        def step():
            raise RuntimeError(os.environ['FAIL_WITH'])
        step()
    sys.exit(3)
"""


def _env(**extra: str) -> dict[str, str]:
    unset = ("OMP_NUM_THREADS", "RANK", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _launch(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor.launch", "--nproc-per-node", "2", str(script), *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _ranks(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^rank=(\d) (.*)$", stdout, re.M))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "show_env.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_runs_two_ranks_with_one_thread_each(script: Path) -> None:
    proc = _launch(script, "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    ranks = _ranks(proc.stdout)
    assert ranks == {
        "0": "world=2 omp=1 threads=1 mmap=1073741824 args=['--lr', '0.1']",
        "1": "world=2 omp=1 threads=1 mmap=1073741824 args=['--lr', '0.1']",
    }


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_keeps_the_users_omp_num_threads(script: Path) -> None:
    proc = _launch(script, OMP_NUM_THREADS="2", MALLOC_MMAP_THRESHOLD_="65536")
    assert proc.returncode == 0, proc.stderr
    ranks = _ranks(proc.stdout)
    assert sorted(ranks) == ["0", "1"]
    assert all(v == "world=2 omp=2 threads=2 mmap=65536 args=[]" for v in ranks.values())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_failed_run_ends_with_a_short_summary(script: Path) -> None:
    words = " ".join(f"word{i}" for i in range(60))  # more than 3 summary lines hold
    proc = _launch(script, FAIL_RANK="1", FAIL_WITH=f"rank 1: stage 1 failed\n{words}")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    end = max(i for i, line in enumerate(lines) if line.startswith("====="))
    summary = lines[end + 1 :]  # after torchrun's report
    assert 3 <= len(summary) <= 5
    head = "conveyor launch: rank 1 failed first (exit 1): RuntimeError: rank 1: stage 1 failed "
    assert summary[0].startswith(head)
    assert summary[1].startswith("  ") and summary[2].startswith("  ")
    assert all(len(line) <= 100 for line in summary)
    said = " ".join(line.strip() for line in summary[:3])[len(head) :].split()
    assert said[-1] == "..." and said[:-1] == [f"word{i}" for i in range(len(said) - 1)]
    assert summary[3:] in ([], ["conveyor launch: torchrun then stopped rank 0"])
    # The worker's own traceback is above it, starting at the script's frames.
    at = lines.index("Traceback (most recent call last):")
    assert lines[at + 1] == f'  File "{script}", line 11, in <module>'
    assert lines[at + 5].startswith("RuntimeError: rank 1: stage 1 failed")
    assert "show_env.py FAILED" in proc.stderr  # torchrun's report names the script
    assert "rank      : 1" in proc.stderr


class _Failure(NamedTuple):
    exitcode: int
    message: Any
    timestamp: int


def _recorded(text: str, when: float) -> dict[str, Any]:
    return {"message": text, "extraInfo": {"timestamp": str(int(when)), "time": when}}


def test_failure_summary_orders_by_the_workers_own_time() -> None:
    failures = {
        0: _Failure(1, _recorded("PipelineError: rank 0: waited for rank 2", 100.7), 100),
        1: _Failure(-15, "Signal 15 (SIGTERM) received by PID 7", 100),
        2: _Failure(1, _recorded("ValueError: bad batch", 100.2), 100),
        3: _Failure(-9, "Signal 9 (SIGKILL) received by PID 9", 101),
    }
    assert conveyor.cli.launch.failure_summary(failures).splitlines() == [
        "conveyor launch: rank 2 failed first (exit 1): ValueError: bad batch",
        "conveyor launch: also failed: rank 0 (exit 1), rank 3 (killed by SIGKILL)",
        "conveyor launch: torchrun then stopped rank 1",
    ]
    assert conveyor.cli.launch.exit_code(failures) == 1
    killed = {5: _Failure(-9, "Signal 9 (SIGKILL) received by PID 9", 101)}
    assert conveyor.cli.launch.failure_summary(killed) == (
        "conveyor launch: rank 5 failed first: killed by SIGKILL"
    )
    assert conveyor.cli.launch.exit_code(killed) == 1
    exited = {0: _Failure(-15, "Signal 15", 7), 1: _Failure(3, "To enable traceback see: x", 7)}
    assert conveyor.cli.launch.exit_code(exited) == 3  # the failing worker's own code
    assert conveyor.cli.launch.failure_summary(exited).splitlines() == [
        "conveyor launch: rank 1 failed first (exit 3) without an exception; see its output",
        "conveyor launch: torchrun then stopped rank 0",
    ]


def test_failure_summary_wraps_a_long_error_between_words() -> None:
    message = "PipelineError: " + " ".join(["supercalifragilistic"] * 30)
    summary = conveyor.cli.launch.failure_summary({1: _Failure(1, _recorded(message, 5.0), 5)})
    lines = summary.splitlines()
    assert len(lines) == 3 and all(len(line) <= 100 for line in lines)
    assert lines[-1].endswith("supercalifragilistic ...")
    words = " ".join(lines).split("PipelineError: ")[1].split()
    assert set(words) == {"supercalifragilistic", "..."}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_main_in_process(
    script: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert conveyor.cli.launch.main(["--nproc-per-node", "2", str(script), "x"]) == 0
    assert os.environ["OMP_NUM_THREADS"] == "1"
    ranks = _ranks(capfd.readouterr().out)
    assert ranks["0"] == ranks["1"] == "world=2 omp=1 threads=1 mmap=1073741824 args=['x']"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_demo_trains_two_stages_end_to_end() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conveyor.cli",
            "demo",
            "--nproc",
            "2",
            "--epochs",
            "3",
            "--lr",
            "3e-3",
            "--max-restarts",
            "1",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy = re.search(r"held-out accuracy: ([\d.]+)% \((\d+)/450\)", proc.stdout)
    assert accuracy is not None, proc.stdout
    assert float(accuracy.group(1)) >= 90.0
    step = re.search(r"median step: ([\d.]+) ms \(1f1b, 2 stage\(s\) on 2 process", proc.stdout)
    assert step is not None and float(step.group(1)) > 0
    bubble = re.search(r"bubble: measured ([\d.]+), simulated ([\d.]+)", proc.stdout)
    assert bubble is not None
    assert 0 < float(bubble.group(1)) < 1 and 0 < float(bubble.group(2)) < 1
    gap = re.search(r"gap: a step simulated from those costs takes ([\d.]+) ms", proc.stdout)
    assert gap is not None and 0 < float(gap.group(1)) < float(step.group(1))
    # Only rank 0 reports; in a log a line per epoch (and the first step), no progress bar.
    assert proc.stdout.count("held-out accuracy") == 1
    assert [int(n) for n in re.findall(r"^step +(\d+)", proc.stdout, re.M)] == [1, 21, 42, 63]
    assert "step/s" not in proc.stderr and "|" not in proc.stderr


def _launched(argv: list[str], accuracy: float, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Run ``conveyor demo argv`` with a launcher that only parses its command line as
    torchrun does and reports ``accuracy`` as the workers would."""
    from torch.distributed.run import parse_args

    configs: list[Any] = []

    def launch(args: list[str]) -> int:
        config = parse_args(args)  # type: ignore[no-untyped-call]
        configs.append(config)
        script_args = config.training_script_args
        result = script_args[script_args.index("--result-file") + 1]
        Path(result).write_text(json.dumps({"accuracy": accuracy}))
        return 0

    monkeypatch.setattr(conveyor.cli.launch, "main", launch)
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun
    configs.append(demo.main(argv))
    return configs


def test_demo_nproc_reaches_torchrun_and_not_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["--nproc", "3", "--epochs", "2", "--lr=0.003", "--max-restarts", "2"]
    config, code = _launched(argv, 0.95, monkeypatch)
    assert code == 0
    assert (config.nproc_per_node, config.max_restarts) == ("3", 2)
    assert (config.module, config.training_script) == (True, "conveyor.cli.demo")
    args = config.training_script_args
    assert args[:4] == ["--epochs", "2", "--lr", "0.003"] and args[4] == "--result-file"
    assert len(args) == 6  # --nproc and --max-restarts are the launcher's alone


def test_demo_checks_the_accuracy_in_the_launcher(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, code = _launched(["--nproc", "2", "--max-restarts", "3"], 0.42, monkeypatch)
    assert code == demo.LOW_ACCURACY == 3
    assert capsys.readouterr().err == (
        "conveyor demo: held-out accuracy 42.0% is below --min-accuracy 0.9; train longer "
        "(--epochs) or pass --min-accuracy 0 to skip the check\n"
    )
    _, code = _launched(["--nproc", "2", "--min-accuracy", "0"], 0.42, monkeypatch)
    assert code == 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_demo_in_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun
    low = ["--nproc", "1", "--epochs", "1", "--lr", "1e-7"]
    assert demo.main(low) == demo.LOW_ACCURACY
    out, err = capsys.readouterr()
    accuracy = re.search(r"held-out accuracy: ([\d.]+)%", out)
    assert accuracy is not None and float(accuracy.group(1)) < 90.0
    assert "2 stage(s) in one process (2 pipeline ranks simulated)" in out
    assert "bubble: not measured (one process runs the stages one after another), simulated" in out
    assert "bubble 0." not in out and "gap:" not in out
    assert err.startswith("conveyor demo: held-out accuracy") and err.count("\n") == 1
    # A worker of a launched demo reports the accuracy and leaves the check to the launcher.
    result = tmp_path / "result.json"
    assert demo.main([*low, "--result-file", str(result)]) == 0
    reported = json.loads(result.read_text())["accuracy"]
    assert reported == pytest.approx(float(accuracy.group(1)) / 100, abs=5e-4)
    assert demo.main([*low, "--min-accuracy", "0"]) == 0


def test_measured_costs_are_per_stage_means() -> None:
    timings = [
        (0, "F", 0, 0, 0.0, 1.0),
        (0, "F", 0, 1, 1.0, 4.0),
        (1, "F", 1, 0, 1.0, 3.0),
        (1, "B", 1, 0, 3.0, 7.0),
        (0, "B", 0, 0, 7.0, 9.0),
        (0, "W", 0, 0, 9.0, 9.5),
    ]
    assert measured_costs(timings, 3) == [(2.0, 2.0, 0.5), (2.0, 4.0, 0.0), (0.0, 0.0, 0.0)]


# --- the launcher's rendezvous edges ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_static_rendezvous_with_restarts_on_several_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.run

    def started(config: Any) -> None:
        raise AssertionError("torchrun started: the static rendezvous waits for the other node")

    monkeypatch.setattr(torch.distributed.run, "run", started)
    for name in ("OMP_NUM_THREADS", *conveyor.cli.launch.MALLOC_TUNABLES):
        monkeypatch.delenv(name, raising=False)  # the launcher sets them; restored after
    argv = [
        "launch",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--max-restarts",
        "1",
        "--nproc-per-node",
        "1",
        "train.py",
    ]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        "conveyor launch: error: --max-restarts 1 with --nnodes 2 needs the c10d rendezvous"
    ), err
    assert "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB" in err


def test_launch_help_shows_two_machines(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    example = out.index("two machines")
    assert example < out.index("--nproc-per-node NPROC_PER_NODE")
    command = " ".join(out[example:].split("\n\n")[0].replace("\\\n", " ").split())
    assert (
        "conveyor launch --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "
        "HOST:29400 --rdzv-id job1"
    ) in command


def test_rendezvous_summary_formats_torchs_errors() -> None:
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import get_args_parser

    config = get_args_parser().parse_args(  # torchrun's arguments, as launch parses them
        [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "host0:29400",
            "--rdzv-conf",
            "join_timeout=20",
            "train.py",
        ]
    )
    summary = conveyor.cli.launch.rendezvous_summary(RendezvousTimeoutError(), config)
    lines = summary.splitlines()
    assert len(lines) <= 4 and all(len(line) <= 100 for line in lines)
    assert " ".join(line.strip() for line in lines) == (
        "conveyor launch: the c10d rendezvous at host0:29400 did not gather --nnodes 2 nodes "
        "within join_timeout=20 s; start conveyor launch on every node with the same --nnodes, "
        "--rdzv-endpoint and --rdzv-id, and check that host0:29400 is reachable from each"
    )
    refused = RendezvousConnectionError(
        "The connection to the C10d store has failed. See inner exception for details."
    )
    lines = conveyor.cli.launch.rendezvous_summary(refused, config).splitlines()
    assert len(lines) <= 4 and all(len(line) <= 100 for line in lines)
    assert " ".join(line.strip() for line in lines) == (
        "conveyor launch: the c10d rendezvous at host0:29400 failed: RendezvousConnectionError: "
        "The connection to the C10d store has failed. See inner exception for details; start "
        "conveyor launch on every node with the same --nnodes, --rdzv-endpoint and --rdzv-id, "
        "and check that host0:29400 is reachable from each"
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_c10d_peer_that_never_arrives_ends_with_the_summary(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conveyor.launch",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "edge",
            "--rdzv-conf",
            "join_timeout=3",
            str(script),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "never runs" not in proc.stdout, proc.stderr
    tail = " ".join(proc.stderr.split("conveyor launch: ", 1)[-1].split())
    assert tail.startswith(
        f"the c10d rendezvous at 127.0.0.1:{port} did not gather --nnodes 2 nodes within "
        f"join_timeout=3 s;"
    ), proc.stderr
