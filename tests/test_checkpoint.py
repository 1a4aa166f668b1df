"""Checkpoints: saved by one split, loaded by any other and by the plain model; atomic;
clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

import conveyor
import conveyor.checkpoint as ckpt
from tests import distributed
from tests.models import assert_close, mlp
from tests.zoo import TinyGPT

BEFORE, AFTER = 2, 2  # steps before the save, steps after the load
LR = 1e-2
TIED = {"lm_head.weight": "tok_emb.weight"}  # the head's name for the tied embedding


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a function of the step alone, as a resumed run needs."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 11, (8, 5), generator=g)
    return x, (x * 3 + 1) % 11


def _train(pipe: conveyor.Pipeline | nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = _data(step)
        if isinstance(pipe, conveyor.Pipeline):
            pipe.train_step(x, y)
        else:
            _lm_loss(pipe(x), y).backward()
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


def _adamw(target: conveyor.Pipeline | nn.Module, lr: float = LR) -> torch.optim.AdamW:
    # eps well above float rounding: the key bias's true gradient is 0 (softmax ignores a
    # shift), and Adam would blow its rounding noise up to full-size, run-dependent steps.
    return torch.optim.AdamW(target.parameters(), lr=lr, weight_decay=0.1, eps=1e-3)


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
    same 2 processes: the tied weight on both) with a wrong learning rate, and go on."""
    ctx = conveyor.init()
    pipe = conveyor.Pipeline(TinyGPT(), loss_fn=_lm_loss, microbatches=2, context=ctx)
    opt = _adamw(pipe)
    _train(pipe, opt, range(BEFORE))
    conveyor.save(pipe, path, opt, step=BEFORE)
    saved = (_params(pipe), _opt_state(pipe, opt))

    again = conveyor.Pipeline(
        TinyGPT(), loss_fn=_lm_loss, microbatches=4, schedule="interleaved-1f1b", chunks=2
    )
    opt2 = _adamw(again, lr=123.0)
    step = conveyor.load(again, path, opt2)
    loaded = (_params(again), _opt_state(again, opt2), opt2.param_groups[0]["lr"])
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


def test_save_at_pp2_loads_anywhere_and_training_continues(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results = distributed.run(_save_then_reload, 2, path)
    want_state, want_opt, want_final = _reference()
    want_params = {n: want_state[n] for n in want_final}

    # What the 2 ranks saved is the unsplit model's state after BEFORE steps (the tied
    # weight is tok_emb.weight on rank 0 and lm_head.weight on rank 1).
    for r in results:
        params, opt_state = r["saved"]
        assert_close(params, {n: want_state[n] for n in params}, "saved params")
        _assert_same_state(opt_state, _pick(want_opt, opt_state), "saved optimizer")

    # Stored once: under its first name, the other name an alias.
    where = ckpt._resolve(path)
    stored = FileSystemReader(where).read_metadata().state_dict_metadata
    assert "model/tok_emb.weight" in stored and "model/lm_head.weight" not in stored
    assert "optim/tok_emb.weight/exp_avg" in stored and not any("lm_head" in k for k in stored)

    # Reloaded into interleaved-1F1B on 2 processes: the same state, lr restored, and
    # training goes on to the uninterrupted run's parameters.
    for r in results:
        assert r["step"] == BEFORE
        params, opt_state, lr = r["loaded"]
        assert lr == LR
        assert_close(params, {n: want_state[n] for n in params}, "reloaded params")
        _assert_same_state(opt_state, _pick(want_opt, opt_state), "reloaded optimizer")
        assert_close(r["final"], _pick(want_final, r["final"]), "continued")

    # The plain model: its state dict, then model + optimizer through conveyor.load.
    state = conveyor.load_model_state(path)
    assert set(state) == set(want_state)
    assert_close(state, want_state, "load_model_state")
    model = TinyGPT()
    model.load_state_dict(state)
    opt = _adamw(model, lr=5.0)
    assert conveyor.load(model, path, opt) == BEFORE
    assert opt.param_groups[0]["lr"] == LR
    _assert_same_state(_opt_state(model, opt), want_opt, "plain optimizer")
    _train(model, opt, range(BEFORE, BEFORE + AFTER))
    assert_close(_params(model), want_final, "plain continued")

    # 4 pipeline ranks x 2 chunks in one process.
    conveyor.init(pp=4)
    pipe = conveyor.Pipeline(
        TinyGPT(), loss_fn=_lm_loss, microbatches=4, schedule="interleaved-1f1b", chunks=2
    )
    opt = _adamw(pipe, lr=5.0)
    assert conveyor.load(pipe, path, opt) == BEFORE
    assert_close(_params(pipe), want_params, "pp=4 params")
    _assert_same_state(_opt_state(pipe, opt), want_opt, "pp=4 optimizer")
    _train(pipe, opt, range(BEFORE, BEFORE + AFTER))
    assert_close(_params(pipe), want_final, "pp=4 continued")


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
    with monkeypatch.context() as m:
        m.setattr(ckpt.layout, "_fsync_dir", die)
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

    other = conveyor.Pipeline(TinyGPT(), loss_fn=_lm_loss, microbatches=2)
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
