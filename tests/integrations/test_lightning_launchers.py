"""``start_method="popen"`` and ``"spawn"`` with ``devices=2``, for ``lightning`` and the
standalone ``pytorch_lightning``: Lightning starts the processes itself (gloo), and the
step losses and trained weights are those of the unsplit network trained on the
whole batches."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

import conveyor
from tests.support import lightning_launched as script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_the_strategy_and_its_launcher_pickle_by_name(package: str) -> None:
    """What spawn sends to each worker: the strategy (in the Trainer) and the launcher,
    each a class of its package's module, found there by name."""
    module = importlib.import_module(f"conveyor.integrations.{package}")
    parallel = importlib.import_module(
        "lightning.pytorch.strategies" if package == "lightning" else "pytorch_lightning.strategies"
    ).ParallelStrategy
    assert issubclass(module.PipelineStrategy, parallel)
    strategy = module.PipelineStrategy(pp=2, microbatches=4, start_method="spawn")
    copy = pickle.loads(pickle.dumps(strategy))
    assert type(copy) is module.PipelineStrategy
    assert copy.init_options == {"pp": 2, "dp": 1}
    assert copy.pipeline_options == {"microbatches": 4}
    launcher = module.Launcher(strategy, start_method="spawn")
    assert type(pickle.loads(pickle.dumps(launcher))) is module.Launcher


def unsplit_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit network's whole-batch losses and final weights, on the batches
    Lightning's DistributedSampler gives one replica (shuffled, seed 0, per epoch)."""
    net = script.network()
    opt = script.optimizer(net.parameters())
    sampler = DistributedSampler(script.data(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(script.data(), batch_size=script.BATCH, sampler=sampler)
    losses = []
    for epoch in range(script.EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses, net.state_dict()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_starts_two_processes(package: str, start_method: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # Lightning's launcher starts the world itself
    command = [sys.executable, script.__file__, package, start_method, str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=280)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    losses, weights = unsplit_run()
    assert len(losses) == 12
    for rank in range(2):  # every rank's loss is the whole batch's
        got = torch.load(tmp_path / f"losses-{rank}.pt")
        worst = max(abs(x - y) / abs(y) for x, y in zip(got, losses, strict=True))
        print(f"{package}, {start_method}, rank {rank}: max relative loss difference {worst:.1e}")
        assert len(got) == len(losses) and worst < 1e-5
    saved = conveyor.load_model_state(tmp_path / "ckpt")  # every stage's part
    returned = torch.load(tmp_path / "returned.pt") if start_method == "spawn" else None
    for name, value in weights.items():
        assert rel(saved[name], value) < 1e-5, name
        if returned is not None:  # the main process got the whole trained network
            assert rel(returned[name], value) < 1e-5, name
