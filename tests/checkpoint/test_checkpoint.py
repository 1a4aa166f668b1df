"""Checkpoints: saved by one split, loaded by any other and by the plain model; atomic;
clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

import conveyor
import conveyor.checkpoint as ckpt
from tests.support import distributed
from tests.support.helpers import assert_close, lm_loss
from tests.support.models import mlp
from tests.support.zoo import TinyGPT

ROOT = Path(__file__).resolve().parents[2]

BEFORE, AFTER = 2, 2  # steps before the save, steps after the load
LR = 1e-2
TIED = {"lm_head.weight": "tok_emb.weight"}  # the head's name for the tied embedding


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a function of the step alone, as a resumed run needs."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 11, (8, 5), generator=g)
    return x, (x * 3 + 1) % 11


def _train(pipe: conveyor.Pipeline | nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = _data(step)
        if isinstance(pipe, conveyor.Pipeline):
            ctx = pipe.context  # with data parallelism each replica trains on its shard
            shard = slice(ctx.dp_rank, None, ctx.dp_size)
            pipe.train_step(x[shard], y[shard])
        else:
            lm_loss(pipe(x), y).backward()
        opt.step()
        opt.zero_grad()


def _named(target: conveyor.Pipeline | nn.Module) -> dict[str, nn.Parameter]:
    return dict(target.named_parameters())


def _params(target: conveyor.Pipeline | nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in _named(target).items()}


def _opt_state(
    target: conveyor.Pipeline | nn.Module, opt: torch.optim.Optimizer
) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's state by parameter name."""
    return {
        n: {k: v.clone() for k, v in opt.state[p].items()}
        for n, p in _named(target).items()
        if p in opt.state
    }


# Three param groups with their own hyperparameters (AdamW): each must come back to its
# own group, whatever split saved or loads it, and in whatever order the groups are listed.
GROUPS: dict[str, dict[str, Any]] = {
    "matrices": {"lr": LR, "weight_decay": 0.1, "betas": (0.9, 0.999)},
    "vectors": {"lr": LR / 2, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    "embeddings": {"lr": 2 * LR, "weight_decay": 0.01, "betas": (0.85, 0.95)},
}
WRONG: dict[str, Any] = {"lr": 123.0, "weight_decay": 0.5, "betas": (0.5, 0.5)}
EMBEDDINGS = {"tok_emb.weight", "lm_head.weight", "pos_emb"}


def _group(name: str, p: torch.Tensor) -> str:
    if name in EMBEDDINGS:
        return "embeddings"
    return "matrices" if p.dim() >= 2 else "vectors"


def _adamw(
    target: conveyor.Pipeline | nn.Module, wrong: bool = False, order: tuple[str, ...] = ()
) -> torch.optim.AdamW:
    """AdamW over GROUPS (in ``order``, default GROUPS'); ``wrong``: every group built with
    WRONG hyperparameters, for a load to restore. A rank's empty groups are left out."""
    named = _named(target)
    groups: list[dict[str, Any]] = []
    for g in order or tuple(GROUPS):
        params = [p for n, p in named.items() if _group(n, p) == g]
        if params:
            groups.append({"params": params, **(WRONG if wrong else GROUPS[g])})
    # eps well above float rounding: the key bias's true gradient is 0 (softmax ignores a
    # shift), and Adam would blow its rounding noise up to full-size, run-dependent steps.
    return torch.optim.AdamW(groups, eps=1e-3)


def _hypers(target: conveyor.Pipeline | nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    """(group kind of its parameters, its hyperparameters) of every param group."""
    kind = {id(p): _group(n, p) for n, p in _named(target).items()}
    out = []
    for group in opt.param_groups:
        kinds = {kind[id(p)] for p in group["params"]}
        assert len(kinds) == 1, kinds
        out.append((kinds.pop(), {k: group[k] for k in GROUPS["matrices"]}))
    return out


def _assert_hypers(hypers: list[Any], what: str) -> None:
    assert hypers, what
    for kind, got in hypers:
        assert got == GROUPS[kind], f"{what}: {kind} group has {got}, saved {GROUPS[kind]}"


def _assert_same_state(
    got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]], what: str
) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for name in want:
        assert set(got[name]) == {"step", "exp_avg", "exp_avg_sq"}, (what, name, got[name])
        assert_close(got[name], want[name], f"{what} {name}")


def _pick(want: dict[str, Any], names: dict[str, Any]) -> dict[str, Any]:
    """``want``'s entries for ``names``, seeing the head's tied weight as the embedding."""
    return {n: want[TIED.get(n, n)] for n in names}


def _save_then_reload(rank: int, path: str) -> dict[str, Any]:
    """2 processes: train pp=2 1F1B, save; then load into interleaved-1F1B (4 stages on the
    same 2 processes: the tied weight on both) with wrong hyperparameters, and go on."""
    ctx = conveyor.init()
    pipe = conveyor.Pipeline(TinyGPT(), loss_fn=lm_loss, microbatches=2, context=ctx)
    opt = _adamw(pipe)
    _train(pipe, opt, range(BEFORE))
    conveyor.save(pipe, path, opt, step=BEFORE)
    saved = (_params(pipe), _opt_state(pipe, opt))

    again = conveyor.Pipeline(
        TinyGPT(), loss_fn=lm_loss, microbatches=4, schedule="interleaved-1f1b", chunks=2
    )
    opt2 = _adamw(again, wrong=True)
    step = conveyor.load(again, path, opt2)
    loaded = (_params(again), _opt_state(again, opt2), _hypers(again, opt2))
    _train(again, opt2, range(step or 0, BEFORE + AFTER))
    return {"saved": saved, "loaded": loaded, "step": step, "final": _params(again)}


def _reference() -> tuple[dict[str, torch.Tensor], Any, dict[str, torch.Tensor]]:
    """The unsplit model: parameters and optimizer state after BEFORE steps, and the
    parameters after BEFORE + AFTER uninterrupted steps."""
    model = TinyGPT()
    opt = _adamw(model)
    _train(model, opt, range(BEFORE))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = _opt_state(model, opt)
    _train(model, opt, range(BEFORE, BEFORE + AFTER))
    return state, opt_state, _params(model)


@pytest.fixture(scope="module")
def pp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    """The checkpoint that 2 processes saved at pp=2 under 1F1B after BEFORE steps, and
    what each rank saw (see _save_then_reload)."""
    path = str(tmp_path_factory.mktemp("pp2") / "ckpt")
    return path, distributed.run(_save_then_reload, 2, path, fork=True)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_save_at_pp2_loads_anywhere_and_training_continues(
    pp2_checkpoint: tuple[str, list[Any]],
) -> None:
    path, results = pp2_checkpoint
    want_state, want_opt, want_final = _reference()
    want_params = {n: want_state[n] for n in want_final}

    # What the 2 ranks saved is the unsplit model's state after BEFORE steps (the tied
    # weight is tok_emb.weight on rank 0 and lm_head.weight on rank 1).
    for r in results:
        params, opt_state = r["saved"]
        assert_close(params, {n: want_state[n] for n in params}, "saved params")
        _assert_same_state(opt_state, _pick(want_opt, opt_state), "saved optimizer")

    # Stored once: under its first name, the other name an alias.
    where = ckpt.layout.resolve(path)
    stored = FileSystemReader(where).read_metadata().state_dict_metadata
    assert "model/tok_emb.weight" in stored and "model/lm_head.weight" not in stored
    assert "optim/tok_emb.weight/exp_avg" in stored and not any("lm_head" in k for k in stored)

    # Reloaded into interleaved-1F1B on 2 processes: the same state, lr restored, and
    # training goes on to the uninterrupted run's parameters.
    for r in results:
        assert r["step"] == BEFORE
        params, opt_state, hypers = r["loaded"]
        _assert_hypers(hypers, "reloaded at interleaved-1f1b")
        assert_close(params, {n: want_state[n] for n in params}, "reloaded params")
        _assert_same_state(opt_state, _pick(want_opt, opt_state), "reloaded optimizer")
        assert_close(r["final"], _pick(want_final, r["final"]), "continued")

    # The plain model: its state dict, then model + optimizer through conveyor.load.
    state = conveyor.load_model_state(path)
    assert set(state) == set(want_state)
    assert_close(state, want_state, "load_model_state")
    model = TinyGPT()
    model.load_state_dict(state)
    opt = _adamw(model, wrong=True, order=tuple(reversed(GROUPS)))  # groups in another order
    assert conveyor.load(model, path, opt) == BEFORE
    assert [kind for kind, _ in _hypers(model, opt)] == list(reversed(GROUPS))
    _assert_hypers(_hypers(model, opt), "plain model")
    _assert_same_state(_opt_state(model, opt), want_opt, "plain optimizer")
    _train(model, opt, range(BEFORE, BEFORE + AFTER))
    assert_close(_params(model), want_final, "plain continued")

    # 4 pipeline ranks x 2 chunks in one process.
    conveyor.init(pp=4)
    pipe = conveyor.Pipeline(
        TinyGPT(), loss_fn=lm_loss, microbatches=4, schedule="interleaved-1f1b", chunks=2
    )
    opt = _adamw(pipe, wrong=True)
    assert conveyor.load(pipe, path, opt) == BEFORE
    _assert_hypers(_hypers(pipe, opt), "pp=4 in one process")
    assert_close(_params(pipe), want_params, "pp=4 params")
    _assert_same_state(_opt_state(pipe, opt), want_opt, "pp=4 optimizer")
    _train(pipe, opt, range(BEFORE, BEFORE + AFTER))
    assert_close(_params(pipe), want_final, "pp=4 continued")


def _reshard_on_four(rank: int, path: str, dp_path: str) -> dict[str, Any]:
    """4 processes load the pp=2 checkpoint into 8 stages under interleaved 1F1B (pp=4 x 2
    chunks), then into pp=2 x dp=2, and go on training each; the latter saves again."""
    out: dict[str, Any] = {}
    for what in ("8 stages", "pp x dp"):
        if what == "8 stages":
            ctx = conveyor.init(pp=4)
            pipe = conveyor.Pipeline(
                TinyGPT(),
                loss_fn=lm_loss,
                microbatches=4,
                schedule="interleaved-1f1b",
                chunks=2,
                context=ctx,
            )
        else:
            ctx = conveyor.init(pp=2, dp=2)
            pipe = conveyor.Pipeline(TinyGPT(), loss_fn=lm_loss, microbatches=2, context=ctx)
        opt = _adamw(pipe, wrong=True)
        step = conveyor.load(pipe, path, opt)
        held = ctx.pp_rank, ctx.dp_rank, pipe.schedule.stages_of(ctx.pp_rank)
        loaded = _params(pipe), _opt_state(pipe, opt), _hypers(pipe, opt)
        _train(pipe, opt, range(step or 0, BEFORE + AFTER))
        out[what] = {"step": step, "held": held, "loaded": loaded, "final": _params(pipe)}
    conveyor.save(pipe, dp_path, opt, step=BEFORE + AFTER)  # from pp=2 x dp=2
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_checkpoint_loads_into_8_stages_and_pp_x_dp_on_4_processes(
    pp2_checkpoint: tuple[str, list[Any]], tmp_path: Path
) -> None:
    path, _ = pp2_checkpoint
    dp_path = str(tmp_path / "dp")
    results = distributed.run(_reshard_on_four, 4, path, dp_path, fork=True)
    want_state, want_opt, want_final = _reference()
    assert [r["8 stages"]["held"] for r in results] == [(r, 0, (r, r + 4)) for r in range(4)]
    assert [r["pp x dp"]["held"] for r in results] == [
        (0, 0, (0,)),
        (1, 0, (1,)),
        (0, 1, (0,)),
        (1, 1, (1,)),
    ]
    for what in ("8 stages", "pp x dp"):
        names: set[str] = set()
        for rank, r in enumerate(results):
            got = r[what]
            where = f"{what}, rank {rank}"
            assert got["step"] == BEFORE, where
            params, opt_state, hypers = got["loaded"]
            names |= set(params)
            assert_close(params, {n: want_state[n] for n in params}, f"{where} params")
            _assert_same_state(opt_state, _pick(want_opt, opt_state), f"{where} optimizer")
            _assert_hypers(hypers, where)
            assert_close(got["final"], _pick(want_final, got["final"]), f"{where} continued")
        assert {TIED.get(n, n) for n in names} == set(want_final), what  # every parameter

    # Saved from pp=2 x dp=2: replica 1 (ranks 2 and 3) wrote no data; replica 0 wrote all.
    saved = ckpt.layout.resolve(dp_path)
    metadata = FileSystemReader(saved).read_metadata()
    writers = {info.relative_path for info in metadata.storage_data.values()}
    assert writers == {"__0_0.distcp", "__1_0.distcp"}, writers
    for f in saved.glob("__[23]_*.distcp"):
        assert f.stat().st_size == 0, f"{f.name} holds {f.stat().st_size} bytes"
    stored = metadata.state_dict_metadata
    assert {k for k in stored if k.startswith("model/")} == {f"model/{n}" for n in want_final}
    assert {k.rsplit("/", 1)[0] for k in stored if k.startswith("optim/")} == {
        f"optim/{n}" for n in want_final
    }
    state = conveyor.load_model_state(dp_path)
    assert set(state) == set(want_state)
    assert_close(state, {n: want_final[TIED.get(n, n)] for n in state}, "pp x dp saved")


def _mlp_pipe() -> tuple[conveyor.Pipeline, torch.optim.Optimizer]:
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2)
    return pipe, torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)


def _mlp_step(pipe: conveyor.Pipeline, opt: torch.optim.Optimizer) -> None:
    pipe.train_step(torch.randn(4, 8), torch.randn(4, 4))
    opt.step()
    opt.zero_grad()


def test_a_save_that_dies_halfway_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe, opt = _mlp_pipe()
    _mlp_step(pipe, opt)
    conveyor.save(pipe, tmp_path, opt, step=1)
    first = _params(pipe)
    _mlp_step(pipe, opt)
    assert not torch.equal(_params(pipe)["0.weight"], first["0.weight"])

    # Dies after the data files are written, before DCP's metadata.
    def die(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "finish", die)
        with pytest.raises(Exception, match="disk full"):
            conveyor.save(pipe, tmp_path, opt, step=2)
    assert any(p.name.endswith(".tmp") and any(p.iterdir()) for p in tmp_path.iterdir())
    # Dies after the new checkpoint's directory is complete, before `latest` names it.
    replace = os.replace

    def die_naming_latest(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if Path(dst).name == "latest":
            raise OSError("disk full")
        replace(src, dst, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", die_naming_latest)
        with pytest.raises(ckpt.CheckpointError, match="disk full"):
            conveyor.save(pipe, tmp_path, opt, step=3)

    fresh, opt2 = _mlp_pipe()
    assert conveyor.load(fresh, tmp_path, opt2) == 1
    assert_close(_params(fresh), first, "after the failed saves")
    assert conveyor.load_model_state(tmp_path).keys() == mlp().state_dict().keys()

    # The next save that succeeds removes what the failed ones left.
    conveyor.save(pipe, tmp_path, opt, step=4)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0] == "latest" and names[1].startswith("step-00000004-")
    assert conveyor.load(fresh, tmp_path, opt2) == 4
    assert_close(_params(fresh), _params(pipe), "after the next save")


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    pipe, opt = _mlp_pipe()
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        conveyor.load(pipe, tmp_path / "nowhere")
    assert not ckpt.exists(tmp_path / "nowhere") and not ckpt.exists(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="no latest file"):
        conveyor.load_model_state(tmp_path)
    with pytest.raises(conveyor.ConfigError, match="step must be an int"):
        conveyor.save(pipe, tmp_path, step=-1)

    conveyor.save(pipe, tmp_path)  # the model only, no step
    assert ckpt.exists(tmp_path)
    assert conveyor.load(pipe, tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match=r"no optimizer state.*load without"):
        conveyor.load(pipe, tmp_path, opt)

    other = conveyor.Pipeline(TinyGPT(), loss_fn=lm_loss, microbatches=2)
    with pytest.raises(ckpt.CheckpointError, match=r"lacks \d+ entries .* different model"):
        conveyor.load(other, tmp_path)
    wider = conveyor.Pipeline(mlp(width=32), loss_fn=nn.functional.mse_loss, microbatches=2)
    with pytest.raises(ckpt.CheckpointError, match=r"shape .* same sizes"):
        conveyor.load(wider, tmp_path)

    conveyor.save(pipe, tmp_path, opt, step=7)
    with pytest.raises(ckpt.CheckpointError, match="holds SGD state, but the optimizer is Adam"):
        conveyor.load(pipe, tmp_path, torch.optim.Adam(pipe.parameters()))
    with pytest.raises(ckpt.CheckpointError, match="not this pipeline's"):
        conveyor.save(pipe, tmp_path, torch.optim.SGD(mlp().parameters(), lr=0.1))
    assert conveyor.load(pipe, tmp_path, opt) == 7


class _WithExtra(nn.Linear):
    """A layer with non-tensor extra state (a dict), which DCP must not take apart."""

    def get_extra_state(self) -> Any:
        return {"calls": getattr(self, "calls", 0)}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def test_a_plain_module_with_extra_state_round_trips(tmp_path: Path) -> None:
    model = nn.Sequential(_WithExtra(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].calls = 7
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    conveyor.save(model, tmp_path, opt, step=1)

    again = nn.Sequential(_WithExtra(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt2 = torch.optim.SGD(again.parameters(), lr=9.0, momentum=0.5)
    assert conveyor.load(again, tmp_path, opt2) == 1
    assert again[0].calls == 7 and opt2.param_groups[0]["lr"] == 0.1
    assert_close(_params(again), _params(model), "params")
    assert_close(
        {n: opt2.state[p]["momentum_buffer"] for n, p in again.named_parameters()},
        {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()},
        "momentum",
    )
    state = conveyor.load_model_state(tmp_path)
    assert state["0._extra_state"] == {"calls": 7}
    fresh = nn.Sequential(_WithExtra(3, 4), nn.Tanh(), nn.Linear(4, 2))
    fresh.load_state_dict(state)
    assert fresh[0].calls == 7


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
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1
    assert done.stderr.count("CheckpointError: ") == 1, done.stderr
    assert "During handling" not in done.stderr and "direct cause" not in done.stderr
    assert "no checkpoint at nowhere" in done.stderr
