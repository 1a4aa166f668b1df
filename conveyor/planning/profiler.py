"""Profile a model layer by layer: times of F, B, W and the bytes each layer holds.

The model is cut into its smallest units with the same splitter the pipeline uses
(``split_model(model, n, [1] * n)``: a layer of a layer list, a step of an execution
sequence, a leaf-module call or parameter-reading operation of a traced graph), so a
balance over these units is exactly a ``balance=`` the pipeline accepts. Each unit runs on
one real micro-batch chained from the previous unit's output; its F, B and W are timed the
way the runtime runs them (``LinearWeightStore`` capture, ``backward_input``,
``WeightWork.run`` + ``flush``), and its whole backward the way non-split schedules run it.
Times are medians over ``repeats`` after ``warmup`` runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError
from conveyor.partition import split_model
from conveyor.partition.annotations import stage_marks, stage_of
from conveyor.partition.execution import ExecutionSequence
from conveyor.partition.sequential import layers_of, split_sequential
from conveyor.runtime import microbatch
from conveyor.runtime.call import StageCaller
from conveyor.runtime.deferred_linear import LinearWeightStore
from conveyor.runtime.split_backward import backward_input

LossFn = Callable[[Any, Any], torch.Tensor]

# Without a process group there is nothing to measure; these are typical of gloo over
# loopback on one machine (tens of microseconds per message, a few GB/s).
DEFAULT_LATENCY = 50e-6
DEFAULT_BANDWIDTH = 3e9


@dataclass(frozen=True)
class LayerProfile:
    """One unit on one micro-batch. Times in seconds, sizes in bytes.

    ``forward``: F as split-backward schedules run it (linear weights deferred);
    ``forward_plain``: F as other schedules run it; ``backward_input`` / ``backward_weight``:
    B and W of a split backward; ``backward``: the whole backward. ``activations``: what
    autograd saves for the backward (parameters excluded); ``parameters``: the unit's
    parameter bytes; ``output``: bytes of what it passes to the next unit.
    """

    name: str
    forward: float
    forward_plain: float
    backward_input: float
    backward_weight: float
    backward: float
    activations: int
    parameters: int
    output: int

    def time(self, split: bool) -> float:
        """F + B + W (split backward) or F + whole backward."""
        if split:
            return self.forward + self.backward_input + self.backward_weight
        return self.forward_plain + self.backward


@dataclass(frozen=True)
class Profile:
    """Per-unit measurements at one micro-batch size, and the link between ranks."""

    layers: tuple[LayerProfile, ...]
    microbatches: int
    microbatch_size: int
    latency: float
    bandwidth: float

    def times(self, split: bool) -> list[float]:
        """Each unit's time for one micro-batch (see :meth:`LayerProfile.time`)."""
        return [layer.time(split) for layer in self.layers]

    def costs(self, balance: Sequence[int], split: bool) -> list[tuple[float, float, float]]:
        """(F, B, W) per stage of ``balance`` (units per stage), for :func:`simulate`.

        Without ``split`` W is 0 and B is the whole backward, which the simulator charges
        as B + W anyway.
        """
        out = []
        for part in _parts(self.layers, balance):
            if split:
                out.append(
                    (
                        sum(u.forward for u in part),
                        sum(u.backward_input for u in part),
                        sum(u.backward_weight for u in part),
                    )
                )
            else:
                out.append((sum(u.forward_plain for u in part), sum(u.backward for u in part), 0.0))
        return out

    def calibrated(
        self, forward: float, backward: float, weight: float, split: bool, latency: float
    ) -> Profile:
        """This profile with F, B and W times scaled by what a real run measured (for the
        split backward when ``split``, else for plain F and the whole backward) and the
        link latency replaced: see :func:`conveyor.planning.planner.calibrate_family`."""

        def scale(u: LayerProfile) -> LayerProfile:
            if split:
                return dataclasses.replace(
                    u,
                    forward=u.forward * forward,
                    backward_input=u.backward_input * backward,
                    backward_weight=u.backward_weight * weight,
                )
            return dataclasses.replace(
                u, forward_plain=u.forward_plain * forward, backward=u.backward * backward
            )

        layers = tuple(scale(u) for u in self.layers)
        return dataclasses.replace(self, layers=layers, latency=latency)

    def comm(self, balance: Sequence[int]) -> float:
        """Seconds of the slowest transfer between stages of ``balance``:
        latency + boundary bytes / bandwidth (the simulator takes one number)."""
        parts = _parts(self.layers, balance)
        sizes = [part[-1].output for part in parts[:-1]]
        return self.latency + max(sizes, default=0) / self.bandwidth

    def parameter_bytes(self, balance: Sequence[int]) -> list[int]:
        """Parameter bytes per stage."""
        return [sum(u.parameters for u in part) for part in _parts(self.layers, balance)]

    def activation_bytes(self, balance: Sequence[int]) -> list[int]:
        """Bytes one micro-batch keeps alive on each stage between its F and backward."""
        return [sum(u.activations for u in part) for part in _parts(self.layers, balance)]


def _parts(layers: Sequence[LayerProfile], balance: Sequence[int]) -> list[list[LayerProfile]]:
    if sum(balance) != len(layers) or min(balance, default=0) < 1:
        raise ConfigError(
            f"balance {list(balance)} does not cover the {len(layers)} profiled units; give "
            f"counts >= 1 that add up to {len(layers)}"
        )
    out, start = [], 0
    for size in balance:
        out.append(list(layers[start : start + size]))
        start += size
    return out


# ---------------------------------------------------------------------------- units
def _annotated(model: nn.Module | Sequence[nn.Module]) -> bool:
    if isinstance(model, ExecutionSequence):
        return bool(stage_marks(model.__dict__["source"]))
    if isinstance(model, nn.Module):
        return any(stage_of(m) is not None for m in model.modules())
    return any(stage_of(m) is not None for layer in model for m in layer.modules())


def units(model: nn.Module | Sequence[nn.Module], sample: Any = None) -> list[nn.Module]:
    """The model cut into the units ``balance=`` counts, one module each (``sample``: one
    micro-batch of input, for a model captured with torch.export).

    Raises :class:`ConfigError` for a model with ``pipeline_stage`` annotations (they fix
    the split; there is nothing to plan) unless it is a layer list.
    """
    if isinstance(model, ExecutionSequence):
        if _annotated(model):
            raise ConfigError(_ANNOTATED)
        n = len(model.steps)
    elif isinstance(model, nn.Module) and not isinstance(model, (nn.Sequential, nn.ModuleList)):
        if _annotated(model):
            raise ConfigError(_ANNOTATED)
        from conveyor.partition.graph import layer_count

        n = layer_count(model, sample)
    else:
        # Layer lists: cut directly so annotations on layers do not get in the way.
        n = len(layers_of(model))
        return list(split_sequential(model, n, [1] * n))
    return split_model(model, n, [1] * n, sample)


_ANNOTATED = (
    "the model has pipeline_stage annotations, which fix its split; remove them to let "
    "the planner choose the balance, or pass a schedule by name"
)


# ---------------------------------------------------------------------------- measuring
def _nbytes(value: Any) -> int:
    return sum(
        x.numel() * x.element_size()
        for x in pytree.tree_leaves(value)
        if isinstance(x, torch.Tensor)
    )


def _fresh(value: Any) -> Any:
    """Detached copy of ``value`` whose float tensors require grad (a received input)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if x.is_floating_point():
                x.requires_grad_(True)
        return x

    return pytree.tree_map(leaf, value)


def _grad_leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor) and x.requires_grad]


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _saved_bytes(run: Callable[[], Any], params: list[torch.Tensor]) -> tuple[Any, int]:
    """Run ``run`` and count the bytes autograd saves (each storage once, parameters and
    their views excluded)."""
    owned = {p.untyped_storage().data_ptr() for p in params}
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        # Views of one micro-batch of a bigger batch count their own size, not the storage's.
        key = (t.data_ptr(), t.numel())
        if t.untyped_storage().data_ptr() not in owned and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, total


def _measure_unit(
    index: int,
    unit: nn.Module,
    value: Any,
    target: Any,
    loss_fn: LossFn | None,
    repeats: int,
    warmup: int,
    clock: _Clock,
) -> tuple[LayerProfile, Any]:
    first = index == 0
    params: list[torch.Tensor] = [p for p in unit.parameters() if p.requires_grad]
    store = LinearWeightStore(params)
    keep = [p.grad for p in params]
    call = StageCaller()

    def forward(split: bool) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], Any]:
        x = _fresh(value)
        ins = _grad_leaves(x)
        if split:
            with store.capture((0, 0)):
                out = call(index, unit, x, first)
                loss = loss_fn(out, target) if loss_fn is not None else None
        else:
            out = call(index, unit, x, first)
            loss = loss_fn(out, target) if loss_fn is not None else None
        outs = [loss] if loss is not None else _grad_leaves(out)
        return out, ins, outs, loss

    def out_grads(outs: list[torch.Tensor], loss: Any) -> list[torch.Tensor] | None:
        return None if loss is not None else [torch.ones_like(o) for o in outs]

    f_split, f_plain, b_in, b_w, b_all = [], [], [], [], []
    for r in range(warmup + repeats):
        t0 = clock.now()
        out, ins, outs, loss = forward(split=True)
        t1 = clock.now()
        grads = out_grads(outs, loss)
        if outs:
            _, work = backward_input(outs, grads, ins, params)
        t2 = clock.now()
        if outs:
            work.run()
        store.flush([(0, 0)])
        t3 = clock.now()
        out, ins, outs, loss = forward(split=False)
        t4 = clock.now()
        grads = out_grads(outs, loss)
        if outs:
            torch.autograd.backward(outs, grads)
        t5 = clock.now()
        if r >= warmup:
            f_split.append(t1 - t0)
            b_in.append(t2 - t1)
            b_w.append(t3 - t2)
            f_plain.append(t4 - t3)
            b_all.append(t5 - t4)
    for p, g in zip(params, keep, strict=True):
        p.grad = g

    def run() -> Any:
        return forward(split=False)

    (out, _, _, _), saved = _saved_bytes(run, list(unit.parameters()))
    med = statistics.median
    layer = LayerProfile(
        name=f"unit {index}: {_describe(unit)}",
        forward=med(f_split),
        forward_plain=med(f_plain),
        backward_input=med(b_in),
        backward_weight=med(b_w),
        backward=med(b_all),
        activations=saved,
        parameters=sum(p.numel() * p.element_size() for p in unit.parameters()),
        output=_nbytes(out) if loss_fn is None else 0,
    )
    detached = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
    return layer, detached


def _describe(unit: nn.Module) -> str:
    children = list(unit.named_children())
    if len(children) == 1:
        name, child = children[0]
        return f"{name} ({type(child).__name__})"
    return type(unit).__name__


def _parameters(model: nn.Module | Sequence[nn.Module]) -> list[nn.Parameter]:
    if isinstance(model, nn.Module):
        return list(model.parameters())
    return [p for layer in model for p in layer.parameters()]


def _first_microbatch(batch: Any, microbatches: int, what: str, device: torch.device) -> Any:
    return microbatch.to_device(microbatch.split(batch, microbatches, what)[0], device)


def profile(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    microbatches: int,
    *,
    repeats: int = 5,
    warmup: int = 2,
    measure_link: bool = True,
) -> Profile:
    """Measure every unit of ``model`` on the first of ``microbatches`` micro-batches.

    ``inputs`` / ``targets``: a whole batch, as for ``Pipeline.train_step``. In a
    distributed world this is a collective: every rank profiles at the same time and all
    get the mean over ranks, and the latency and bandwidth between ranks 0 and 1 are
    measured by ping-pong (with ``measure_link``); otherwise the link gets
    :data:`DEFAULT_LATENCY` and :data:`DEFAULT_BANDWIDTH`. Gradients already in ``.grad``
    are left as they were.
    """
    distributed = dist.is_available() and dist.is_initialized()
    latency, bandwidth = DEFAULT_LATENCY, DEFAULT_BANDWIDTH
    if distributed and measure_link and dist.get_world_size() > 1:
        latency, bandwidth = measure_link_speed()
    layers = _profile_units(model, inputs, targets, loss_fn, microbatches, repeats, warmup)
    if distributed:
        # Every rank profiles at once, as they compute at once in the pipeline: on shared
        # cores or memory bandwidth a unit is slower then than alone. All ranks take the
        # mean over ranks, so they agree on the numbers and plan the same.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, layers)
        layers = _mean_layers(gathered)
    size = microbatch.batch_size(inputs, "inputs")
    return Profile(layers, microbatches, -(-size // microbatches), latency, bandwidth)


def _mean_layers(per_rank: Sequence[Sequence[LayerProfile]]) -> tuple[LayerProfile, ...]:
    out = []
    for same in zip(*per_rank, strict=True):

        def mean(field: str, same: tuple[LayerProfile, ...] = same) -> float:
            return statistics.fmean(getattr(u, field) for u in same)

        out.append(
            dataclasses.replace(
                same[0],
                forward=mean("forward"),
                forward_plain=mean("forward_plain"),
                backward_input=mean("backward_input"),
                backward_weight=mean("backward_weight"),
                backward=mean("backward"),
            )
        )
    return tuple(out)


def _profile_units(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    microbatches: int,
    repeats: int,
    warmup: int,
) -> tuple[LayerProfile, ...]:
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device = next((p.device for p in _parameters(model)), torch.device("cpu"))
    clock = _Clock(device)
    value = _first_microbatch(inputs, microbatches, "inputs", device)
    parts = units(model, value)
    target = _first_microbatch(targets, microbatches, "targets", device)
    out: list[LayerProfile] = []
    for i, unit in enumerate(parts):
        last = i == len(parts) - 1
        layer, value = _measure_unit(
            i, unit, value, target, loss_fn if last else None, repeats, warmup, clock
        )
        out.append(layer)
    return tuple(out)


def measure_link_speed(
    small: int = 4, large: int = 1 << 20, rounds: int = 10
) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) between ranks 0 and 1 by ping-pong.

    A collective: every rank calls it; ranks other than 0 and 1 only receive the result.
    One-way time = half a round trip (median); latency from ``small`` floats, bandwidth
    from the extra time of ``large`` bytes.
    """
    rank = dist.get_rank()
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def one_way(numel: int) -> float:
        buf = torch.zeros(numel, device=device)
        times = []
        for r in range(rounds + 2):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if r >= 2:
                times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times)

    result = torch.zeros(2, dtype=torch.float64)
    if rank in (0, 1):
        lat = one_way(small)
        big = one_way(large // 4)
        result[0] = lat
        result[1] = large / max(big - lat, 1e-9)
    dist.broadcast(result, 0)
    return float(result[0]), float(result[1])
