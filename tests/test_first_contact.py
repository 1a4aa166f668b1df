"""The first things a new user types: one process runs the pipeline its arguments describe,
every rank gets parameters, mistakes are caught up front, a rank that stops between steps
or skips a collective is named, checkpoints are one import away, the planner is stable."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import one_line
from conveyor.planning.planner import OUTLIER, plan
from conveyor.planning.profiler import profile
from tests import distributed
from tests.models import batch, mlp

ROOT = Path(__file__).resolve().parents[1]


def _readme_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


# ---------------------------------------------------------------------------- one process
def test_one_process_runs_as_many_ranks_as_balance_or_annotations_say() -> None:
    ctx = conveyor.init()  # no torchrun, no pp: a world of one process
    model = _readme_model()
    pipe = conveyor.Pipeline(model, loss_fn=nn.functional.cross_entropy, microbatches=4,
                             balance=[3, 3], context=ctx)
    assert pipe.schedule.ranks == 2 and len(pipe.stages) == 2
    x, y = torch.randn(8, 8, 8), torch.randint(0, 10, (8,))
    loss = pipe.train_step(x, y)
    want = nn.functional.cross_entropy(_readme_model()(x), y)
    assert float(loss) == pytest.approx(want.item(), rel=1e-6)
    annotated = _readme_model()
    annotated[3].pipeline_stage = 1  # type: ignore[assignment]
    annotated[5].pipeline_stage = 2  # type: ignore[assignment]
    pipe = conveyor.Pipeline(annotated, loss_fn=nn.functional.cross_entropy, microbatches=3,
                             context=ctx)
    assert pipe.schedule.ranks == 3
    # init(pp=...) is a promise: a balance that does not fit it is still an error
    with pytest.raises(conveyor.ConfigError, match=r"has 2 entries but the pipeline has 4"):
        conveyor.Pipeline(_readme_model(), loss_fn=nn.functional.cross_entropy,
                          microbatches=4, balance=[3, 3], context=conveyor.init(pp=4))


def test_every_rank_gets_parameters() -> None:
    # 10 layers, 5 with parameters, on 4 ranks x 2 chunks: 8 stages, so some stage has
    # none, but every rank must hold one that has (here rank 0 used to get only Flatten
    # and a ReLU).
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Flatten()]
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    layers.append(nn.Linear(16, 4))
    model = nn.Sequential(*layers)
    ctx = conveyor.init(pp=4)
    pipe = conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=4,
                             schedule="interleaved-1f1b", chunks=2, context=ctx)
    sched = pipe.schedule
    for rank in range(4):
        held = sched.stages_of(rank)
        assert any(p.numel() for s in held for p in pipe.stages[s].parameters()), rank
    # too few layers with parameters for the ranks: said at construction
    few = nn.Sequential(nn.Flatten(), nn.Linear(16, 16), nn.ReLU(), nn.Tanh(), nn.ReLU(),
                        nn.Linear(16, 4), nn.Tanh(), nn.ReLU())
    with pytest.raises(conveyor.ConfigError, match=r"leaves pipeline rank \d .* without "
                       r"parameters.*fewer ranks"):
        conveyor.Pipeline(few, loss_fn=nn.functional.mse_loss, microbatches=4, context=ctx)


def test_inputs_and_targets_of_different_batch_sizes() -> None:
    pipe = conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2,
                             context=conveyor.init(pp=2))
    x, _ = batch(8)
    _, y = batch(6)
    with pytest.raises(conveyor.ConfigError, match=r"inputs hold 8 samples but targets hold 6"):
        pipe.train_step(x, y)


def test_the_trace_keeps_the_last_training_step() -> None:
    pipe = conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2,
                             context=conveyor.init(pp=2))
    x, y = batch(8)
    pipe.train_step(x, y)
    kinds = sorted({t[1] for t in pipe.last_step_timings()})
    pipe.predict(x)
    pipe.eval_step(x, y)
    assert sorted({t[1] for t in pipe.last_step_timings()}) == kinds == ["B", "F"]


# ---------------------------------------------------------------------------- errors
def test_short_errors_are_cut_between_words() -> None:
    long = RuntimeError("Timed out waiting 3000ms for send operation to complete " * 10)
    text = one_line(long, 80).removeprefix("RuntimeError: ")
    assert len(text) <= 84 and text.endswith(" ...")
    assert text[:-4] == text[:-4].rstrip() and (long.args[0]).startswith(text[:-4])
    assert long.args[0][len(text) - 4] == " "  # the cut falls before a space


def _between_steps(rank: int, what: str) -> str:
    """Rank 1 leaves after the first step (or skips a collective); rank 0 goes on."""
    ctx = conveyor.init(pp=2, timeout=3.0)
    pipe = conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2,
                             context=ctx)
    x, y = batch(8)
    pipe.train_step(x, y)
    if rank == 1:
        if what == "dies":
            import os

            os._exit(0)
        time.sleep(5)  # alive, but never calls the collective
        return "rank 1 skipped it"
    start = time.monotonic()
    try:
        if what == "save":
            conveyor.save(pipe, "/tmp/conveyor-test-skip-save-never-committed")
        else:
            pipe.train_step(x, y)
    except conveyor.PipelineError as e:
        return f"{time.monotonic() - start:.1f}s {e}"
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("what", ["dies", "save"])
def test_a_rank_missing_between_steps_is_named(what: str) -> None:
    results = distributed.run(_between_steps, 2, what, expect=[0], timeout=120)
    seconds, text = results[0].split("s ", 1)
    assert float(seconds) < 20, results[0]
    if what == "save":
        assert "rank 0: agreeing on the checkpoint" in text, text
        assert "every rank must call conveyor.save" in text, text
    else:
        assert "rank 0: starting a step" in text, text
        assert "rank 1" in text, text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoint_is_one_attribute_away_and_fails_once(tmp_path: Path) -> None:
    script = (
        "import conveyor\n"
        "assert conveyor.checkpoint.exists('nowhere') is False\n"
        "assert conveyor.CheckpointError is conveyor.checkpoint.CheckpointError\n"
        "import torch\n"
        "conveyor.load(torch.nn.Linear(2, 2), 'nowhere')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 1
    assert done.stderr.count("CheckpointError: ") == 1, done.stderr
    assert "During handling" not in done.stderr and "direct cause" not in done.stderr
    assert "no checkpoint at nowhere" in done.stderr


# ---------------------------------------------------------------------------- planner
def _plan_inputs() -> tuple[nn.Module, Any, Any, Any]:
    model = _readme_model()
    x, y = torch.randn(64, 8, 8), torch.randint(0, 10, (64,))
    return model, x, y, nn.functional.cross_entropy


def test_the_planner_measures_an_outlier_again() -> None:
    model, x, y, loss_fn = _plan_inputs()
    profiles = {m: profile(model, x, y, loss_fn, m) for m in (2, 4, 8, 16)}
    slow = profiles[4]
    import dataclasses

    # One count's profile disturbed 100x (what a stall during profiling looked like).
    profiles[4] = dataclasses.replace(slow, layers=tuple(
        dataclasses.replace(u, forward=u.forward * 100, forward_plain=u.forward_plain * 100,
                            backward=u.backward * 100, backward_input=u.backward_input * 100,
                            backward_weight=u.backward_weight * 100)
        for u in slow.layers
    ))
    chosen = plan(model, x, y, loss_fn, 2, profiles=profiles)
    at4 = [c.predicted_step for c in chosen.alternatives if c.microbatches == 4]
    others = [c.predicted_step for c in chosen.alternatives if c.microbatches == 2]
    assert at4 and max(at4) < OUTLIER * 10 * min(others)  # measured again: no 100x row


def test_the_planner_chooses_the_same_among_near_ties() -> None:
    model, x, y, loss_fn = _plan_inputs()
    base = {m: profile(model, x, y, loss_fn, m) for m in (2, 4, 8, 16)}
    import dataclasses

    def jitter(factor: float) -> dict[int, Any]:
        return {
            m: dataclasses.replace(p, layers=tuple(
                dataclasses.replace(u, forward=u.forward * factor ** (i % 3 - 1))
                for i, u in enumerate(p.layers)
            ))
            for m, p in base.items()
        }

    picks = {
        (c.schedule, c.chunks, c.microbatches)
        for c in (plan(model, x, y, loss_fn, 2, profiles=jitter(f)) for f in (0.98, 1.0, 1.02))
    }
    assert len(picks) == 1, picks


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
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "terminate called" not in out and "SIGABRT" not in out, out
        assert out.count("done") == 2, out
