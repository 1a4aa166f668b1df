"""Activation recompute and autocast through the pipeline.

Recompute (fp32, dropout-free) gives the unsplit model's gradients; with dropout it gives
exactly the gradients of the same pipeline without recompute under the same seed (micro-
batching changes how a whole-batch model would draw its masks, so that is the comparison
that can be exact). Under ``autocast=torch.bfloat16`` gradients stay fp32 and match the
unsplit model run under the same autocast within bf16 rounding, and differ from the fp32
model's by more than that (an fp32 run fails both checks); activations leave every stage
and cross ranks as bf16. Recompute lowers the bytes of tensors alive at a step's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.runtime.memory import TensorMemory
from tests.support import distributed
from tests.support.helpers import assert_close, grads_of, merge, mse, pipelined, reference, rel_err
from tests.support.models import batch, mlp

# (schedule, chunks, micro-batches, recompute): whole and split backward, every stage or some.
RECOMPUTE = [
    ("gpipe", 1, 3, True),
    ("1f1b", 1, 4, True),
    ("1f1b", 1, 4, [0]),
    ("interleaved-1f1b", 2, 4, {1, 2}),
    ("zb-h1", 1, 4, True),
    ("zb-h2", 1, 5, [1]),
    ("zbv", 2, 4, True),
    ("dualpipev", 2, 5, {0, 3}),
    ("zb-late", 1, 3, True),
]
# (schedule, chunks, recompute) under autocast=torch.bfloat16, 4 micro-batches.
AUTOCAST = [("1f1b", 1, False), ("zb-h1", 1, False), ("zb-h1", 1, True), ("zbv", 2, True)]
SIZES = [10, 7]  # two steps, uneven micro-batches
# Measured on this model (16 samples, 4 micro-batches), bf16 pipeline vs the unsplit model
# under bf16 autocast: loss 8e-8 (the forward is row-wise: micro-batching rounds nothing
# differently), gradients at most 3.6e-3 per tensor (accumulation over micro-batches). An
# fp32 pipeline vs the same reference: loss 8e-5, gradients up to 1.1e-2; and the bf16
# pipeline's gradients differ from the fp32 model's by 3.5e-3 overall, an fp32 run's by 1e-7.
# The gradients are checked to what one rounding to bf16 reaches (rounding_bound).
AUTOCAST_LOSS_TOL = 1e-6
BF16_FLOOR = 1e-3


def _steps() -> list[Any]:
    return [batch(n, seed=i) for i, n in enumerate(SIZES)]


def _dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(8, 16)]
    for _ in range(4):
        mods += [nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 16)]
    mods.append(nn.Linear(16, 4))
    return nn.Sequential(*mods)


def _wide_mlp() -> nn.Sequential:
    """Activations (64 rows x 128 per micro-batch) larger than weight-gradient temporaries."""
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(8, 128)]
    for _ in range(10):
        mods += [nn.Tanh(), nn.Linear(128, 128)]
    mods.append(nn.Linear(128, 4))
    return nn.Sequential(*mods)


def _record_dtype(seen: set[str]) -> Callable[[nn.Module, Any, torch.Tensor], None]:
    """A forward hook adding the dtype of a module's output to ``seen``."""

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        seen.add(str(output.dtype))

    return hook


def _run_all(rank: int, pp: int) -> dict[Any, Any]:
    """Every check's pipeline runs on this process; returns its results keyed by check."""
    ctx = conveyor.init(pp=pp)
    out: dict[Any, Any] = {}
    for name, chunks, m, rc in RECOMPUTE:
        pipe = conveyor.Pipeline(
            mlp(),
            loss_fn=mse,
            microbatches=m,
            schedule=name,
            chunks=chunks,
            context=ctx,
            recompute=rc,
        )
        out[("recompute", name, chunks, m)] = pipelined(pipe, _steps())
    for name in ("1f1b", "zb-h1"):
        for rc in (False, True):
            pipe = conveyor.Pipeline(
                _dropout_mlp(),
                loss_fn=mse,
                microbatches=4,
                schedule=name,
                context=ctx,
                recompute=rc,
            )
            torch.manual_seed(100 + ctx.rank)  # the same masks with and without recompute
            out[("dropout", name, rc)] = pipelined(pipe, _steps())
    x, y = batch(16, seed=5)
    for name, chunks, rc in AUTOCAST:
        pipe = conveyor.Pipeline(
            mlp(),
            loss_fn=mse,
            microbatches=4,
            schedule=name,
            chunks=chunks,
            context=ctx,
            recompute=rc,
            autocast=torch.bfloat16,
        )
        made: set[str] = set()  # dtypes of what each stage returns
        for stage in pipe.stages:
            stage.register_forward_hook(_record_dtype(made))
        loss = pipe.train_step(x, y).item()
        # what this rank's stages sent ('dtype[shape]' per value, as the run measured it)
        rank = pipe.context.pp_rank
        sent = [s for i in pipe.describe().stages if i.rank == rank for _, s in i.sends if s]
        wire = sorted({"torch." + shape.split("[")[0] for shape in sent})
        dtypes = {str(p.grad.dtype) for p in pipe.parameters() if p.grad is not None}
        grads = grads_of(pipe.named_parameters())
        out[("autocast", name, chunks, rc)] = (loss, grads, wire, dtypes, made)
        out[("autocast-eval", name, chunks, rc)] = pipe.eval_step(x, y).item()
    xw, yw = torch.randn(256, 8), torch.randn(256, 4)
    for rc in (False, True):  # gpipe: every rank holds every micro-batch's activations
        pipe = conveyor.Pipeline(
            _wide_mlp(), loss_fn=mse, microbatches=4, schedule="gpipe", context=ctx, recompute=rc
        )
        pipe.train_step(xw, yw)  # gradients exist before the measured step
        with TensorMemory() as mem:
            pipe.train_step(xw, yw)
        out[("memory", rc)] = mem.peak
    return out


def _autocast_reference(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, Any]]:
    model = mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = mse(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _fp32_reference(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, Any]]:
    model = mlp()
    loss = mse(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _check(results: list[dict[Any, Any]], distributed_world: bool) -> None:
    want_losses, want_grads, want_params = reference(mlp(), _steps())
    for name, chunks, m, _ in RECOMPUTE:
        per_rank = [r[("recompute", name, chunks, m)] for r in results]
        what = f"recompute {name} chunks={chunks} m={m}"
        for losses, _, _ in per_rank:
            assert losses == pytest.approx(want_losses, rel=1e-5), what
        assert_close(merge([g for _, g, _ in per_rank]), want_grads, what + " grads")
        assert_close(merge([p for _, _, p in per_rank]), want_params, what + " params")
    for name in ("1f1b", "zb-h1"):
        for rank in results:
            plain, recomputed = rank[("dropout", name, False)], rank[("dropout", name, True)]
            assert plain[0] == pytest.approx(recomputed[0], rel=1e-6), name
            assert_close(recomputed[1], plain[1], f"dropout {name} grads")
            assert_close(recomputed[2], plain[2], f"dropout {name} params")
    x, y = batch(16, seed=5)
    ref_loss, ref_grads = _autocast_reference(x, y)
    fp32_loss, fp32_grads = _fp32_reference(x, y)
    assert abs(fp32_loss / ref_loss - 1) > 10 * AUTOCAST_LOSS_TOL  # they can be told apart
    for name, chunks, rc in AUTOCAST:
        what = f"autocast {name} chunks={chunks} recompute={rc}"
        per_rank = [r[("autocast", name, chunks, rc)] for r in results]
        for loss, _, _, dtypes, made in per_rank:
            assert loss == pytest.approx(ref_loss, rel=AUTOCAST_LOSS_TOL), what
            assert dtypes <= {"torch.float32"}, f"{what}: gradient dtypes {dtypes}"
            assert made == {"torch.bfloat16"}, f"{what}: stages returned {made}"
        for r in results:
            eval_loss = r[("autocast-eval", name, chunks, rc)]
            assert eval_loss == pytest.approx(ref_loss, rel=AUTOCAST_LOSS_TOL), what
        grads = merge([g for _, g, _, _, _ in per_rank])
        assert_close(grads, ref_grads, what, reduction=1, dtype=torch.bfloat16)
        # bf16 really ran: the gradients are not the fp32 model's.
        flat = [torch.cat([d[n].flatten() for n in sorted(d)]) for d in (grads, fp32_grads)]
        assert rel_err(*flat) > BF16_FLOOR, f"{what}: gradients equal fp32's"
        if distributed_world:  # activations crossed ranks as bf16
            assert per_rank[0][2] == ["torch.bfloat16"], f"{what}: sent {per_rank[0][2]}"
    for r in results:
        without, with_ = r[("memory", False)], r[("memory", True)]
        assert 0 < with_ < 0.6 * without, f"peak bytes {with_} with recompute, {without} without"


def test_single_process_world() -> None:
    _check([_run_all(0, pp=2)], distributed_world=False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes() -> None:
    _check(distributed.run(_run_all, 2, 2, fork=True), distributed_world=True)


def test_bad_options_say_what_is_valid() -> None:
    ctx = conveyor.init(pp=2)
    with pytest.raises(conveyor.ConfigError, match=r"stages are 0\.\.1"):
        conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=2, context=ctx, recompute=[2])
    with pytest.raises(conveyor.ConfigError, match="stage indices"):
        conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=2, context=ctx, recompute=3)  # type: ignore[arg-type]
    with pytest.raises(conveyor.ConfigError, match=r"torch\.bfloat16 or torch\.float16"):
        conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=2, context=ctx, autocast=torch.int8)
