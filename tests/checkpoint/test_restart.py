"""Surviving a lost process: ``conveyor launch --max-restarts`` plus checkpoints.

A rank killed mid-run (SIGKILL) is restarted with the others by torchrun, they resume from
the last checkpoint, and the run ends exactly where an uninterrupted one does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import conveyor
from conveyor.cli import demo
from tests.support.helpers import assert_close
from tests.support.models import mlp
from tests.support.restart_train import batch, optimizer

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    unset = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_rank_restarts_and_the_run_ends_like_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    steps, every, kill_at = 10, 4, 6
    ck, out = tmp_path / "ckpt", tmp_path / "final"
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.launch", "--nproc-per-node", "2", "--max-restarts",
         "1", "tests/support/restart_train.py", "--checkpoint", str(ck), "--out", str(out),
         "--steps", str(steps), "--save-every", str(every), "--kill-at", str(kill_at)],
        cwd=ROOT, env=_env(CONVEYOR_TIMEOUT="30"), capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    # Which rank torchrun reports as failed first (rank 1 killed, or rank 0 after it saw
    # its peer gone) is a race, so the kill is read from the script's own line.
    assert f"rank 1 kills itself before step {kill_at}" in proc.stdout, log
    for rank in (0, 1):  # both ranks came back from the checkpoint of step 4
        assert f"rank {rank} attempt 0 starts at step 0" in proc.stdout, log
        assert f"rank {rank} attempt 1 starts at step {every}" in proc.stdout, log
        assert f"rank {rank} attempt 1 done" in proc.stdout, log

    # The uninterrupted run, on the unsplit model.
    model = mlp()
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    assert_close(conveyor.load_model_state(out), model.state_dict(), "after the restart")
    again = mlp()
    opt2 = optimizer(again.parameters())
    assert conveyor.load(again, out, opt2) == steps
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert float(opt2.state[q]["step"]) == steps  # no step lost or repeated
        assert_close(
            {"exp_avg": opt2.state[q]["exp_avg"]}, {"exp_avg": opt.state[p]["exp_avg"]}, "adam"
        )


def _demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The demo in this process (both stages, no launch): its exit code and output."""
    code = demo.main(["--nproc", "1", "--lr", "3e-3", *args])
    return code, capsys.readouterr().out


def test_the_demo_resumes_from_its_checkpoint_with_the_same_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = str(tmp_path / "ckpt")
    _demo(capsys, "--epochs", "1", "--checkpoint", ck, "--save-every", "5")  # 21 steps
    code, resumed = _demo(capsys, "--epochs", "2", "--checkpoint", ck)
    assert code == 0 and "resumed from" in resumed and "at step 21 of 42" in resumed, resumed
    code, straight = _demo(capsys, "--epochs", "2")
    assert code == 0, straight

    def accuracy(out: str) -> str:
        found = re.search(r"held-out accuracy: .*", out)
        assert found is not None, out
        return found.group(0)

    assert accuracy(resumed) == accuracy(straight)
    assert conveyor.load(demo.build_model(), ck) == 42
    code, again = _demo(capsys, "--epochs", "2", "--checkpoint", ck)  # nothing left to do
    assert code == 0 and "at step 42 of 42" in again and accuracy(again) == accuracy(straight)
