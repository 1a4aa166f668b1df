"""``conveyor.launch`` (a torchrun front) and ``conveyor.demo`` end to end, in subprocesses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import conveyor.launch
from conveyor.trace import measured_costs

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """\
import os, sys
import torch
print(f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
      f"omp={os.environ.get('OMP_NUM_THREADS')} threads={torch.get_num_threads()} "
      f"mmap={os.environ.get('MALLOC_MMAP_THRESHOLD_')} "
      f"args={sys.argv[1:]}", flush=True)
sys.exit(3 if os.environ['RANK'] == os.environ.get('FAIL_RANK') else 0)
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
        cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=60,
    )


def _ranks(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^rank=(\d) (.*)$", stdout, re.M))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "show_env.py"
    path.write_text(SCRIPT)
    return path


def test_launch_runs_two_ranks_with_one_thread_each(script: Path) -> None:
    proc = _launch(script, "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    ranks = _ranks(proc.stdout)
    assert ranks == {
        "0": "world=2 omp=1 threads=1 mmap=1073741824 args=['--lr', '0.1']",
        "1": "world=2 omp=1 threads=1 mmap=1073741824 args=['--lr', '0.1']",
    }


def test_launch_keeps_the_users_omp_num_threads(script: Path) -> None:
    proc = _launch(script, OMP_NUM_THREADS="2", MALLOC_MMAP_THRESHOLD_="65536")
    assert proc.returncode == 0, proc.stderr
    ranks = _ranks(proc.stdout)
    assert sorted(ranks) == ["0", "1"]
    assert all(v == "world=2 omp=2 threads=2 mmap=65536 args=[]" for v in ranks.values())


def test_launch_returns_the_failing_workers_exit_code(script: Path) -> None:
    proc = _launch(script, FAIL_RANK="1")
    assert proc.returncode == 3
    assert "rank      : 1" in proc.stderr


def test_launch_main_in_process(
    script: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert conveyor.launch.main(["--nproc-per-node", "2", str(script), "x"]) == 0
    assert os.environ["OMP_NUM_THREADS"] == "1"
    ranks = _ranks(capfd.readouterr().out)
    assert ranks["0"] == ranks["1"] == "world=2 omp=1 threads=1 mmap=1073741824 args=['x']"


@pytest.mark.timeout(60)
def test_demo_trains_two_stages_end_to_end() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.demo", "--epochs", "3", "--lr", "3e-3"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=45,
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
    # Only rank 0 reports.
    assert proc.stdout.count("held-out accuracy") == 1
    assert "train" in proc.stderr  # the progress bar


@pytest.mark.timeout(60)
def test_demo_fails_when_accuracy_is_low() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.demo", "--epochs", "1", "--lr", "1e-7", "--nproc", "1"],
        cwd=ROOT, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=45,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    accuracy = re.search(r"held-out accuracy: ([\d.]+)%", proc.stdout)
    assert accuracy is not None and float(accuracy.group(1)) < 90.0


def test_measured_costs_are_per_stage_means() -> None:
    timings = [
        (0, "F", 0, 0, 0.0, 1.0), (0, "F", 0, 1, 1.0, 4.0), (1, "F", 1, 0, 1.0, 3.0),
        (1, "B", 1, 0, 3.0, 7.0), (0, "B", 0, 0, 7.0, 9.0), (0, "W", 0, 0, 9.0, 9.5),
    ]
    assert measured_costs(timings, 3) == [(2.0, 2.0, 0.5), (2.0, 4.0, 0.0), (0.0, 0.0, 0.0)]
