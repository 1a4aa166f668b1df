"""``conveyor.Trainer``: exact resumption, who reads the data, sharding, callbacks, errors."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import conveyor
from conveyor.context import current
from conveyor.training import (
    Callback,
    CSVLogger,
    EvalMonitor,
    FitState,
    LossMonitor,
    LRSchedule,
    TensorBoard,
    Trainer,
)
from tests.support import distributed
from tests.support.helpers import reset_context
from tests.support.trainer_forked import run_forked

ROOT = Path(__file__).resolve().parents[2]


def model(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """6 layers for 2 or 3 stages of 2: 8 features in, 4 classes out. Built from ``seed``;
    the global generator (its seed and state) is left as it was."""
    outer, state = torch.initial_seed(), torch.get_rng_state()
    torch.manual_seed(seed)
    built = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 4),
    )  # fmt: skip
    torch.manual_seed(outer)
    torch.set_rng_state(state)
    return built


def samples(n: int = 96, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :4].argmax(dim=1))


class Recording(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples that remember which indices were read."""

    def __init__(self, n: int = 96) -> None:
        self.x, self.y = samples(n)
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(int(i))
        return self.x[i], self.y[i]


def trainer(
    pp: int = 2, dropout: float = 0.0, checkpoint: Path | None = None, every: int | None = None,
    **kwargs: Any,
) -> Trainer:  # fmt: skip
    """A pipeline of ``pp`` stages, AdamW and a step-wise LambdaLR, in a fresh trainer."""
    # Under processes, the context their init(dp=...) made; in one process, pp stages.
    ctx = current() if dist.is_initialized() else conveyor.init(pp=pp)
    pipe = conveyor.Pipeline(
        model(dropout=dropout), loss_fn=nn.functional.cross_entropy, microbatches=2,
        balance=[6 // ctx.pp_size] * ctx.pp_size, context=ctx,
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    return Trainer(
        pipe, opt, lr_scheduler=sched, checkpoint_dir=checkpoint, checkpoint_every=every, **kwargs
    )


def _params(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.pipe.named_parameters()}


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    data, held = TensorDataset(*samples()), TensorDataset(*samples(40, seed=2))
    fit = {"batch_size": 16, "eval_data": held, "eval_every": 4, "metrics": ["accuracy"]}
    torch.manual_seed(7)  # the data order's seed; dropout draws from the same generator
    straight = trainer(dropout=0.2)
    full = straight.fit(data, max_steps=14, **fit)  # 6 steps per epoch: crosses 2 epochs

    torch.manual_seed(7)
    first = trainer(dropout=0.2, checkpoint=tmp_path, every=4).fit(data, max_steps=9, **fit)
    assert first.losses == full.losses[:9]
    torch.manual_seed(123)  # another process: the checkpoint brings back the seed and RNG
    again = trainer(dropout=0.2, checkpoint=tmp_path, every=4)
    rest = again.fit(data, max_steps=14, resume=True, **fit)

    assert rest.start_step == 9  # the last save of the interrupted run: its last step
    assert rest.losses == full.losses[9:]  # bit for bit: data order, dropout masks, AdamW
    assert rest.learning_rates == full.learning_rates[9:]
    assert rest.evals == full.evals[2:]  # evaluations at steps 12 (4 and 8 were before)
    assert [e["step"] for e in full.evals] == [4.0, 8.0, 12.0]
    after, expected = _params(again), _params(straight)
    assert all(torch.equal(after[n], expected[n]) for n in expected)
    assert sorted(os.listdir(tmp_path / "trainer")) == ["step-00000014"]
    # Resuming a finished fit trains nothing and returns an empty history.
    done = trainer(checkpoint=tmp_path).fit(data, max_steps=14, resume=True, batch_size=16)
    assert done.losses == [] and done.start_step == 14


def _by_epoch(checkpoint: Path | None = None, every: int | None = None) -> Trainer:
    """A trainer whose learning rate halves after each epoch: a LambdaLR in the LRSchedule
    callback (no lr_scheduler), so the schedule's position lives in the callback only."""
    t = trainer(checkpoint=checkpoint, every=every)
    t.lr_scheduler = None
    halving = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda epoch: 0.5**epoch)
    t.callbacks = [LRSchedule(halving, by="epoch")]
    return t


def test_resume_restores_a_callbacks_state(tmp_path: Path) -> None:
    """The learning rate of a LambdaLR stepped by epoch is computed from the epochs it has
    counted, which only the callback's saved state knows (a StepLR, which scales the
    optimizer's restored rate, would hide a lost state)."""
    data = TensorDataset(*samples(64))  # 4 steps of 16 per epoch
    torch.manual_seed(7)
    full = _by_epoch().fit(data, batch_size=16, max_steps=12)
    assert full.learning_rates == [1e-2] * 4 + [5e-3] * 4 + [2.5e-3] * 4
    torch.manual_seed(7)
    _by_epoch(tmp_path, every=3).fit(data, batch_size=16, max_steps=6)  # stops in epoch 2
    torch.manual_seed(123)
    rest = _by_epoch(tmp_path, every=3).fit(data, batch_size=16, max_steps=12, resume=True)
    assert rest.start_step == 6
    assert rest.learning_rates == full.learning_rates[6:]  # 0.005, 0.005, then 0.0025
    assert rest.losses == full.losses[6:]


def test_epochs_shuffle_a_dataset_anew_and_drop_the_partial_batch() -> None:
    data = Recording(100)  # 6 full batches of 16, 4 samples left out each epoch
    history = trainer(pp=2).fit(data, batch_size=16, epochs=2)
    assert len(history.losses) == 12
    first, second = data.seen[:96], data.seen[96:]
    assert len(set(first)) == 96 and len(set(second)) == 96 and first != second
    assert history.losses[-1] < history.losses[0]


def test_a_dataloader_keeps_its_batches_and_collate(tmp_path: Path) -> None:
    x, y = samples(48)
    rows = [{"x": x[i], "y": y[i]} for i in range(48)]
    loader = DataLoader(  # type: ignore[var-annotated]
        rows, batch_size=12, collate_fn=lambda b: (torch.stack([r["x"] for r in b]),
                                                   torch.stack([r["y"] for r in b])),
    )  # fmt: skip
    t = trainer(pp=2)
    history = t.fit(loader, epochs=1)
    assert len(history.losses) == 4
    reference = trainer(pp=2).fit(TensorDataset(x, y), batch_size=12, epochs=1)
    assert reference.losses != history.losses  # a Dataset is shuffled, this loader is not
    expected = []
    plain = model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    for i in range(0, 48, 12):
        loss = nn.functional.cross_entropy(plain(x[i : i + 12]), y[i : i + 12])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        expected.append(loss.item())
    assert history.losses == pytest.approx(expected, rel=1e-5)


class Steps(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        self.calls.append(("fit_start", state.step, state.epoch))

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        self.calls.append(("step", state.step, state.epoch))

    def on_eval_end(self, trainer: Trainer, state: FitState) -> None:
        self.calls.append(("eval", state.step, state.epoch))

    def on_epoch_end(self, trainer: Trainer, state: FitState) -> None:
        self.calls.append(("epoch", state.step, state.epoch))

    def on_fit_end(self, trainer: Trainer, state: FitState) -> None:
        self.calls.append(("fit_end", state.step, state.epoch))


def test_callbacks_see_steps_evaluations_and_epochs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = Steps()
    t = trainer(pp=2)
    sched = torch.optim.lr_scheduler.StepLR(t.optimizer, step_size=1, gamma=0.5)
    t.lr_scheduler = None
    t.callbacks = [
        steps, LRSchedule(sched, by="epoch"), LossMonitor(every=2), EvalMonitor(),
        CSVLogger(tmp_path / "log.csv"), TensorBoard(tmp_path / "tb"),
    ]  # fmt: skip
    data, held = TensorDataset(*samples(64)), TensorDataset(*samples(20, seed=3))
    history = t.fit(data, batch_size=32, epochs=2, eval_data=held, metrics={"acc": "accuracy"})
    assert steps.calls == [
        ("fit_start", 0, 0), ("step", 1, 0), ("step", 2, 0), ("eval", 2, 0), ("epoch", 2, 0),
        ("step", 3, 1), ("step", 4, 1), ("eval", 4, 1), ("epoch", 4, 1), ("fit_end", 4, 1),
    ]  # fmt: skip
    assert history.learning_rates == [1e-2, 1e-2, 5e-3, 5e-3]  # halved after each epoch
    out = capsys.readouterr().out
    assert f"step 2  epoch 1  loss {history.losses[1]:.4f}  lr 0.01" in out
    last = history.evals[-1]
    assert f"eval at step 4 (epoch 2): loss {last['loss']:.4f}  acc {last['acc']:.4f}" in out
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert float(rows[3]["loss"]) == history.losses[3] and rows[2]["eval_acc"] == ""
    assert float(rows[3]["eval_acc"]) == last["acc"] and float(rows[1]["lr"]) == 1e-2
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # The held-out accuracy is the share of right answers over all 20 samples.
    pipe = t.pipe
    out_all = pipe.predict(held.tensors[0])
    right = (out_all.argmax(1) == held.tensors[1]).float().mean().item()
    assert last["acc"] == pytest.approx(right, abs=1e-6)
    assert t.evaluate(held, batch_size=8, metrics=["accuracy"])["accuracy"] == pytest.approx(right)


def test_tensorboard_missing_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(conveyor.ConfigError, match=r"pip install 'conveyor\[tensorboard\]'"):
        TensorBoard("runs")


class Changing(Dataset[Any]):
    """The first 16 samples are (x, y) pairs, later ones dicts."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        x, y = torch.randn(8), torch.tensor(i % 4)
        return (x, y) if i < 16 else {"x": x, "y": y}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"metrics": ["f1"], "eval_data": "held"}, r"^unknown metric 'f1'; use one of \["),
        ({"eval_every": 2}, r"^eval_every needs eval_data= \(the data to evaluate on\)"),
        ({"metrics": ["accuracy"]}, r"^metrics are computed on eval_data; pass eval_data="),
        ({"epochs": None}, r"^fit needs how long to train: pass epochs= .* or max_steps="),
        ({"max_steps": 3}, r"^fit got both epochs=1 and max_steps=3; pass only one of them$"),
        ({"resume": True}, r"^resume=True continues from checkpoint_dir; pass Trainer\("),
        ({"batch_size": None}, r"^train_data is a Dataset, so fit needs batch_size="),
        ({"batch_size": 1}, r"^batch_size must be an int of at least 2 \(1 replica\(s\) x 2"),
    ],
)
def test_bad_arguments_are_one_sentence(call: dict[str, Any], message: str) -> None:
    data = TensorDataset(*samples(32))
    kwargs: dict[str, Any] = {"batch_size": 8, "epochs": 1, **call}
    if kwargs.get("eval_data") == "held":
        kwargs["eval_data"] = data
    with pytest.raises(conveyor.ConfigError, match=message) as error:
        trainer(pp=2).fit(data, **kwargs)
    assert "\n" not in str(error.value)


def test_a_loader_whose_batch_structure_changes_is_one_sentence() -> None:
    loader = DataLoader(Changing(), batch_size=8)  # sequential: batch 2 is the first dict
    with pytest.raises(conveyor.ConfigError) as error:
        trainer(pp=2).fit(loader, epochs=1)
    assert str(error.value) == (
        "train_data's batch 2 of epoch 0 has another structure than its first batch "
        "((dict[x: tensor, y: tensor], None) instead of (tensor, tensor)); make every batch "
        "alike (the same keys and tuple lengths), e.g. with a collate_fn"
    )


def test_trainer_arguments_are_checked() -> None:
    t = trainer(pp=2)
    with pytest.raises(conveyor.ConfigError, match=r"^checkpoint_every needs checkpoint_dir="):
        Trainer(t.pipe, t.optimizer, checkpoint_every=5)
    with pytest.raises(conveyor.ConfigError, match=r"^max_grad_norm must be a number > 0"):
        Trainer(t.pipe, t.optimizer, max_grad_norm=0)
    with pytest.raises(conveyor.ConfigError, match=r"has none of the hooks on_fit_start"):
        Trainer(t.pipe, t.optimizer, callbacks=[object()])  # type: ignore[list-item]


# ---------------------------------------------------------------------- processes
def _reads(rank: int, world: int, dp: int, n: int, batch: int, held: int) -> dict[str, Any]:
    ctx = conveyor.init(dp=dp)  # the harness's time-out ($CONVEYOR_TIMEOUT), not 300 s
    assert ctx.timeout == distributed.CONVEYOR_TIMEOUT, ctx.timeout
    torch.manual_seed(5)
    t = trainer(max_grad_norm=0.5)
    data, evals = Recording(n), Recording(held)
    history = t.fit(
        data, batch_size=batch, epochs=1, eval_data=evals, metrics=["accuracy"], eval_every=3
    )
    return {"seen": data.seen, "held": evals.seen, "losses": history.losses,
            "evals": history.evals}  # fmt: skip


def _reference(
    pp: int, n: int, batch: int, held: int
) -> tuple[list[float], list[dict[str, float]]]:
    """The same fit in one process (every stage here)."""
    reset_context()
    torch.manual_seed(5)
    t = trainer(pp=pp, max_grad_norm=0.5)
    h = t.fit(
        TensorDataset(*samples(n)), batch_size=batch, epochs=1, eval_data=TensorDataset(
            *samples(held)), metrics=["accuracy"], eval_every=3,
    )  # fmt: skip
    return h.losses, h.evals


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_middle_rank_never_reads_the_data() -> None:
    results = run_forked(_reads, 3, 3, 1, 96, 16, 40)
    losses, evals = _reference(3, 96, 16, 40)
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        assert r["evals"][-1]["accuracy"] == pytest.approx(evals[-1]["accuracy"], abs=1e-6)
        assert r["evals"][-1]["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-5)
    assert results[1]["seen"] == [] and results[1]["held"] == []  # stage 1 of 0, 1, 2
    assert sorted(results[0]["seen"]) == sorted(results[2]["seen"]) == list(range(96))
    assert results[0]["seen"] == results[2]["seen"]  # the same order on both ends
    assert sorted(results[2]["held"]) == sorted([*range(40)] * 2)  # evaluated at steps 3 and 6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_data_parallel_replicas_read_their_share_of_each_global_batch() -> None:
    """Global batches of 15 over 2 replicas (8 + 7), evaluation's last batch of 11 (6 + 5):
    every sample read once per epoch and per evaluation, on the inputs' side (stage 0)
    and the targets' side (stage 1), and the losses those of one process."""
    results = run_forked(_reads, 4, 4, 2, 90, 15, 41)  # pp 2 x dp 2: ranks 0, 1 | 2, 3
    losses, evals = _reference(2, 90, 15, 41)
    for r in results:  # the global batch's loss: the one-process run's
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        assert r["evals"][-1]["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-5)
        assert r["evals"][-1]["accuracy"] == pytest.approx(evals[-1]["accuracy"], abs=1e-6)
    assert results[0]["seen"] == results[1]["seen"] and results[2]["seen"] == results[3]["seen"]
    a, b = results[0]["seen"], results[2]["seen"]
    assert len(a) == 48 and len(b) == 42 and sorted(a + b) == list(range(90))
    for step in range(6):  # step k: replica 0 the first 8 of the global batch, replica 1 the rest
        assert set(a[8 * step : 8 * step + 8]).isdisjoint(b[7 * step : 7 * step + 7])
    for side in (0, 1):  # stage 0 reads for the inputs, stage 1 for the metrics' targets
        held = results[side]["held"] + results[2 + side]["held"]
        assert sorted(held) == sorted([*range(41)] * 2)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_rank_resumes_under_launch_max_restarts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CONVEYOR_TIMEOUT="30")
    out = tmp_path / "losses.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.launch", "--nproc-per-node", "2", "--max-restarts",
         "1", "tests/support/trainer_restart.py", str(tmp_path / "ck"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "rank 1 kills itself after step 7" in proc.stdout, log
    assert "attempt 1 resumed at step 6" in proc.stdout, log
    resumed = torch.load(out)
    from tests.support.trainer_restart import fit

    reset_context()
    expected = fit(None, kill=None)
    assert resumed == expected[6:]  # bit for bit, after the restart
