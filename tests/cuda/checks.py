"""The bodies of the CUDA tests, with the device as a parameter.

``test_cuda.py`` calls each with ``torch.device("cuda")`` (skipped where CUDA is absent);
``test_checks_on_cpu.py`` runs the same bodies on the CPU, so their logic is exercised on
every machine. A pipeline here is the one-process world (every pipeline rank's stages in
this process, in a valid order of the schedule) placed on ``device``: the context
``conveyor.init(pp=2)`` returns, with its device replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import conveyor
from conveyor.runtime.memory import MemoryReport, TensorMemory
from conveyor.schedules import execution_order
from conveyor.simulate import peak_activations
from tests.support.helpers import (
    assert_close,
    grads_of,
    memory_model_peak,
    mse,
    pipelined,
    reference,
    rel_err,
)
from tests.support.models import batch, mlp

PP = 2
# One schedule of every family at its own stages per rank, on 2 pipeline ranks.
FAMILIES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-auto", 1),
    ("zbv", 2),
    ("dualpipev", 2),
    ("v-half", 2),
]
EXACT = 1e-5  # fp32 with TF32 off: micro-batching only reorders sums (about 1e-7 here)


def on(device: torch.device) -> conveyor.Context:
    """The one-process world of ``PP`` pipeline ranks, its stages on ``device``."""
    return dataclasses.replace(conveyor.init(pp=PP), device=device)


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """float32 matrix products in full float32 on CUDA (no TF32) within the block."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _steps(device: torch.device, sizes: tuple[int, ...]) -> list[tuple[Any, Any]]:
    """One seeded batch of each size, on ``device``."""
    out = []
    for i, n in enumerate(sizes):
        x, y = batch(n, seed=i)
        out.append((x.to(device), y.to(device)))
    return out


def exact(device: torch.device, name: str, chunks: int) -> None:
    """Three SGD steps of ``name`` (the last batch of uneven size) give the unsplit
    model's losses, gradients and parameters on ``device`` to relative ``EXACT``."""
    steps = _steps(device, (16, 16, 11))
    with full_fp32():
        want_losses, want_grads, want_params = reference(mlp().to(device), steps)
        pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=4, schedule=name,
                                 chunks=chunks, context=on(device))  # fmt: skip
        losses, grads, params = pipelined(pipe, steps)
    assert all(p.device.type == device.type for p in pipe.parameters()), name
    for got, want in zip(losses, want_losses, strict=True):
        assert abs(got - want) <= EXACT * abs(want), (name, losses, want_losses)
    for what, got_all, want_all in (("grad", grads, want_grads), ("param", params, want_params)):
        assert set(got_all) == set(want_all), name
        for key, value in want_all.items():
            err = rel_err(got_all[key].double(), value.double())
            assert err < EXACT, f"{name}: {what} {key} off by {err:.1e}"


def compiled(device: torch.device, name: str, chunks: int, options: dict[str, Any]) -> int:
    """``Pipeline(compile=options)``: two steps (two batch sizes) match the eager unsplit
    model to compiler rounding (the suite's rounding bound). Returns the graphs compiled."""
    torch._dynamo.reset()
    steps = _steps(device, (16, 12))
    with full_fp32():
        want = reference(mlp().to(device), steps)
        pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=4, schedule=name,
                                 chunks=chunks, context=on(device), compile=options)  # fmt: skip
        got = pipelined(pipe, steps)
    assert got[0] == pytest.approx(want[0], rel=1e-5), (name, got[0], want[0])
    assert_close(got[1], want[1], f"{name} compiled grads")
    assert_close(got[2], want[2], f"{name} compiled params")
    stats = pipe.compile_stats
    assert stats is not None, name
    graphs = sum(sum(kinds.values()) for kinds in stats.graphs.values())
    assert graphs > 0, (name, stats)
    return graphs


def autocast(device: torch.device, name: str, chunks: int) -> None:
    """``autocast=torch.bfloat16``: the linear layers compute in bf16 while parameters and
    gradients stay float32, and the loss and gradients are the unsplit model's under the
    same autocast, accumulated over the same micro-batches, to bf16 rounding (checked as
    tests/parallel/test_moe_compose.py does: the rounding bound in bf16 with a rounding per
    layer and direction, the loss to 1e-3)."""
    x, y = (t.to(device) for t in batch(16))
    m = 4
    model = mlp().to(device)
    want_loss = 0.0
    for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(xm)
        loss = mse(out.float(), ym) / m
        loss.backward()
        want_loss += loss.item()
    want = grads_of(model.named_parameters())
    piped = mlp()
    seen: list[torch.dtype] = []
    piped[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    pipe = conveyor.Pipeline(piped, loss_fn=mse, microbatches=m, schedule=name, chunks=chunks,
                             context=on(device), autocast=torch.bfloat16)  # fmt: skip
    loss = pipe.train_step(x, y)
    assert seen and set(seen) == {torch.bfloat16}, (name, seen)
    assert loss.dtype == torch.float32, name
    assert abs(loss.item() - want_loss) <= 1e-3 * abs(want_loss), (name, loss.item(), want_loss)
    grads = grads_of(pipe.named_parameters())
    assert all(g.dtype == torch.float32 for g in grads.values()), name
    assert_close(grads, want, f"{name} bf16", reduction=4, dtype=torch.bfloat16)


# Memory: many layers of activations as large as a weight, so that what the schedule holds
# dominates the step's peak. 16 x (Linear(256), Tanh): each layer saves a (rows, 256)
# float32 input and output; 4 micro-batches of 256 rows.
LAYERS, WIDTH, ROWS, M = 16, 256, 256, 4


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One schedule's measured step: the activation report, the bytes the step allocated
    above what it started with at its peak (CUDA: ``max_memory_allocated`` after a reset,
    less ``memory_allocated`` before; CPU: conveyor's ``TensorMemory``), the simulator's
    bound and the tolerance it was checked with (bytes)."""

    report: MemoryReport
    step_peak: int
    model_peak: int
    simulator_bound: float
    slack: int


def step_memory(device: torch.device, name: str, chunks: int) -> StepMemory:
    """The second step of ``name`` (the first leaves ``.grad`` and CUDA's cuBLAS workspace,
    which are then counted in the start) measured on ``device``, and checked:

    - the schedule's memory model over the one-process order with the measured sizes (what
      each F saved, what each B kept for W) is the runtime's ``simulated_peak``, and at most
      the simulator's per-rank peaks (``peak_activations``, in micro-batches of a rank's
      share) times the measured bytes of one micro-batch through that share, summed over
      the ranks this process runs (their peaks need not coincide; a rank's share is
      counted as its chunks times its largest stage's bytes, stages being unequal);
    - the step's peak above its start is that model's peak, up to a tolerance: below by at
      most the step's inputs (stage 0 saves views of the batch, allocated before the step);
      above by what the model leaves out, which ``slack`` bounds: the output gradients on
      their way to the previous stage's B (the model counts what a stage keeps for its own
      backward), the transients of one action (its input and output gradients, the loss)
      and one weight's gradient before it is added into ``.grad``: 8 activation tensors of
      a micro-batch and 2 weights, plus 64 KiB for scalars (CUDA rounds each allocation up
      to 512 bytes); under a split backward also W's flush, which concatenates each weight's
      (X, dY) over the micro-batches it joins into one GEMM's operands: half the model's
      peak more. On the CPU (``TensorMemory``) the excess is at most 5 activation tensors
      without a split backward and 20 (0.42 of the model's peak, zb-h1, where a flush's
      copies stayed counted until its end) with one.
    """
    ctx = on(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS * M, 8, generator=g).to(device)
    y = torch.randn(ROWS * M, 4, generator=g).to(device)
    pipe = conveyor.Pipeline(mlp(layers=LAYERS, width=WIDTH), loss_fn=mse, microbatches=M,
                             schedule=name, chunks=chunks, context=ctx,
                             track_memory=True)  # fmt: skip
    with full_fp32():
        pipe.train_step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            pipe.train_step(x, y)
            torch.cuda.synchronize(device)
            step_peak = torch.cuda.max_memory_allocated(device) - before
        else:
            with TensorMemory() as meter:
                pipe.train_step(x, y)
            step_peak = meter.peak
    report = pipe.last_step_memory()
    schedule = pipe.schedule
    order = [a for _, a in execution_order(schedule)]
    model_peak = memory_model_peak(order, schedule.split_backward, report)
    assert report.simulated_peak == model_peak, (name, report.simulated_peak, model_peak)
    per_rank = []
    for rank, peak in enumerate(peak_activations(schedule)):
        largest = max(
            report.forward[s, m] + max(report.at_backward.get((s, m), 0), 0)
            for s in schedule.stages_of(rank)
            for m in range(M)
        )
        per_rank.append(peak * schedule.chunks * largest)
    bound = sum(per_rank)
    assert model_peak <= bound * 1.001, (name, model_peak, per_rank)
    activation = ROWS * WIDTH * 4
    weight = WIDTH * WIDTH * 4
    slack = 8 * activation + 2 * weight + 64 * 1024
    if schedule.split_backward:
        slack += model_peak // 2
    inputs = x.numel() * 4
    assert model_peak - inputs <= step_peak <= model_peak + slack, (
        f"{name}: the step's peak {step_peak} B is not the schedule's {model_peak} B "
        f"(-{inputs} / +{slack})"
    )
    if device.type == "cuda":  # the runtime's own reading, from its reset at the step's start
        assert report.device_peak is not None, name
        assert before + model_peak - inputs <= report.device_peak <= before + step_peak, name
    return StepMemory(report, step_peak, model_peak, bound, slack)
