"""A run that trained correctly exits 0: every process group is freed and its gloo worker
threads joined at exit while the interpreter is alive (conveyor/_groups.py says why), with
or without the script's own destroy_process_group(), in every layout (pp, pp x dp, FSDP,
tensor parallelism, all three), also when those threads are starved (pinned to one CPU
beside a busy process, at nice 19) as on a loaded machine. Before this, the mesh groups
were freed only during interpreter finalization (10 threads per process alive after the
exit hooks), where joining their workers could abort; with FSDP or a tp_plan, the stages'
FSDP mesh infos and DTensors still reached the mesh's groups (8 threads left).

At most one group's 2 workers remain: torch itself keeps the default group alive once any
optimizer was created (10 references from C++; also in a plain torch script), and a group
that is never freed is never joined during finalization either."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "exit_train.py"


@pytest.fixture
def pinned() -> Iterator[dict[str, str]]:
    """The environment that pins the training processes to CPU 0 from their
    ``conveyor.init`` on (tests/support/exit_train.py: their imports, before any group
    exists, are not slowed), with a busy process there too, for one test: kept for the
    module, it took a core from every test after it (the zero-bubble one ran 3x slower)."""
    if shutil.which("taskset") is None or not hasattr(os, "sched_setaffinity"):
        yield {}
        return
    # Busy until its parent (this test process) is gone, even if it is killed.
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", spin])
    try:
        yield {"EXIT_TRAIN_CPU": "0"}
    finally:
        hog.kill()
        hog.wait()


# Every layout once (each adds its groups: dp, FSDP's mesh infos, TP's DTensors, all three),
# each schedule family (fused and split backward) and each way of ending (the script
# destroys the default group itself, or leaves it to conveyor) at least once.
RUNS = {
    "pp2-1f1b-own-destroy": ("1f1b", "pp", 2, True),
    "pp2xdp2-zb-h1": ("zb-h1", "dp", 4, False),
    "pp2xdp2-fsdp": ("1f1b", "fsdp", 4, False),
    "pp2xtp2-tp_plan-zb-h1": ("zb-h1", "tp", 4, False),
    "pp2xdp2xtp2-fsdp-tp_plan": ("1f1b", "3d", 8, False),
}


@pytest.mark.parametrize("run", list(RUNS), ids=list(RUNS))
def test_a_finished_run_exits_0_with_every_thread_joined(pinned: dict[str, str], run: str) -> None:
    schedule, layout, processes, destroy = RUNS[run]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
    command += [str(processes), str(SCRIPT), schedule, layout, *(["destroy"] if destroy else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **pinned}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"trained {schedule} {layout}" in done.stdout, done.stdout
    for rank in range(processes):
        line = f"rank {rank}: gloo workers after the exit hooks: "
        left = [x for x in done.stdout.splitlines() if x.startswith(line)]
        assert left and int(left[0][len(line) :]) <= 2, done.stdout
        if pinned:  # every thread left at the end ran on CPU 0, beside the busy process
            assert f"rank {rank}: threads on cpus [0]" in done.stdout, done.stdout


ZB_SCRIPT = """
import torch, conveyor
from torch import nn
ctx = conveyor.init()
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(10)])
pipe = conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=8, schedule="zb-h1")
opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
for step in range(5):
    pipe.train_step(torch.randn(32, 32), torch.randn(32, 32))
    opt.step(); opt.zero_grad()
print("done", ctx.rank, flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_zero_bubble_run_exits_cleanly_every_time(tmp_path: Path) -> None:
    script = tmp_path / "zb.py"
    script.write_text(ZB_SCRIPT)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "conveyor.launch", "--nproc-per-node", "2", str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "terminate called" not in out and "SIGABRT" not in out, out
        assert out.count("done") == 2, out


FAIL_SCRIPT = ROOT / "tests" / "support" / "exit_fail.py"


@pytest.mark.parametrize("how", ["propagate", "catch", "catch-no-board"])
def test_a_run_whose_step_fails_on_one_rank_ends_at_once(how: str) -> None:
    # Rank 1's ConfigError reaches rank 0 within seconds (conveyor's time-out is 60 s), and
    # no process lingers: before, rank 1 sat in its exit hooks and rank 0 waited for the
    # time-out, whether rank 1's script let the error propagate or caught it. Without the
    # board, rank 1 still leaves at once (no exit barrier), which rank 0 sees.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("CONVEYOR_TIMEOUT", None)
    done = subprocess.run(
        [*command, str(FAIL_SCRIPT), how], env=env, capture_output=True, text=True, timeout=240
    )
    ended = time.time()
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    began = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()
             if "failing step at" in line]  # fmt: skip
    assert len(began) == 2, out
    assert ended - max(began) < 15, (ended - max(began), out)
    assert "rank 1: ConfigError: this rank holds a stage that needs targets" in done.stdout, out
    if how == "catch":  # rank 1 ended normally: rank 0 heard of its error from the board
        assert "rank 1: returns normally" in done.stdout, out
        assert (
            "rank 0: PipelineError: rank 1 failed: ConfigError: this rank holds a stage that "
            "needs targets"
        ) in done.stdout, out
    if how == "catch-no-board":
        assert "rank 1: returns normally" in done.stdout, out
        assert "rank 0: PipelineError: rank 0: B(stage 0, micro-batch 0) waiting" in out, out
        assert "rank 1 may have died or stalled" in out, out
    assert "terminate called" not in out, out
