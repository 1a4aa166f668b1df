"""Activation memory of a real step: bytes held for later backward work, and their peak.

An :class:`ActivationMeter` counts what autograd saves for the backward (through
``saved_tensors_hooks``: each saved tensor is held from F until autograd drops it) and
what the split backward keeps from B until W (the deferred GEMMs' inputs and output
gradients, :mod:`conveyor.runtime.deferred_grads`). Tensors sharing memory count once;
parameters never count. Opt-in (``Pipeline(track_memory=True)``): the hooks cost a Python
call per saved tensor. The planner counts a layer's saved bytes with the same meter.

:class:`TensorMemory` counts more: every tensor created in a block and still alive (a
stand-in on CPU for CUDA's allocator statistics), which is what shows recompute's saving
in tests and benchmarks.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conveyor.runtime.sharding import local_shard
from conveyor.schedules.core import Action, B, F

Key = tuple[int, int]  # (data pointer, bytes): one piece of memory


@dataclass(frozen=True)
class MemoryReport:
    """One rank's activation memory in the last step, in bytes.

    ``peak``: the most held at once, measured. ``forward``: per (stage, micro-batch), what
    its F saved; ``at_backward``: under a split backward, how its B changed that (B frees
    the micro-batch's graph and keeps the inputs and output gradients of its weight GEMMs
    for W: :attr:`held`).
    ``simulated_peak``: the peak of the same actions in the same order with those sizes,
    the F part held from F until the last of B / W (as the simulator counts activations),
    the B change from B until W. In the one-process world all three cover every stage.
    ``device_peak``: on CUDA, the most bytes the caching allocator had allocated during
    the step (``torch.cuda.max_memory_allocated``: parameters, gradients and workspace
    too); None on CPU.
    """

    peak: int
    forward: dict[tuple[int, int], int]
    at_backward: dict[tuple[int, int], int]
    simulated_peak: int
    device_peak: int | None = None

    @property
    def held(self) -> dict[tuple[int, int], int]:
        """Under a split backward, per (stage, micro-batch), the bytes held from its B
        until its W (``forward + at_backward``: the inputs and output gradients of its
        weight GEMMs); empty otherwise."""
        return {key: self.forward[key] + change for key, change in self.at_backward.items()}

    @property
    def w_memory(self) -> float | None:
        """The share of what F saved that is still held between B and W, over this
        rank's micro-batches (``zero_bubble_auto``'s ``w_memory``); None without a split
        backward. Above 1 where F saves little beside the GEMM inputs (a ReLU MLP)."""
        held = self.held
        saved = sum(self.forward[key] for key in held)
        return sum(held.values()) / saved if saved else None


class _Held:
    """A saved tensor in autograd's keeping; its death releases the bytes."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _storage(t: torch.Tensor) -> int:
    """Where a parameter's data lives (a DTensor's: its shard's)."""
    return int(local_shard(t).untyped_storage().data_ptr())


class ActivationMeter:
    """Counts the bytes held for backward work on this rank (see the module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = {_storage(p) for p in params}
        self._live: dict[Key, int] = {}  # memory -> how many holders
        self.current = 0
        self.peak = 0
        self.taken = 0  # bytes ever newly held: a delta over an F is what that F saved

    def exclude(self, params: Iterable[torch.Tensor]) -> None:
        """Also leave ``params`` out (FSDP's gathered parameters are new tensors)."""
        self._params |= {_storage(p) for p in params}

    def reset(self) -> None:
        """Start a step: the peak restarts from what is held now."""
        self.peak = self.current

    def _key(self, t: torch.Tensor) -> Key | None:
        t = getattr(t, "_local_tensor", t)  # a DTensor's own shard (no autograd in a hook)
        if t.layout != torch.strided or t.device.type == "meta" or t.numel() == 0:
            return None
        if t.untyped_storage().data_ptr() in self._params:
            return None
        # A micro-batch's slice of a bigger batch counts its own size, not the storage's.
        return t.data_ptr(), t.numel() * t.element_size()

    def _take(self, key: Key) -> None:
        count = self._live.get(key, 0)
        self._live[key] = count + 1
        if count == 0:
            self.current += key[1]
            self.taken += key[1]
            self.peak = max(self.peak, self.current)

    def _drop(self, key: Key) -> None:
        count = self._live[key] - 1
        if count:
            self._live[key] = count
        else:
            del self._live[key]
            self.current -= key[1]

    def track(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count ``tensors`` until each of these objects dies (e.g. kept until W)."""
        for t in tensors:
            key = self._key(t)
            if key is not None:
                self._take(key)
                weakref.finalize(t, self._drop, key)

    def _pack(self, t: torch.Tensor) -> object:
        key = self._key(t)
        if key is None:
            return t
        # Detached: holding the tensor itself would tie an output to its own grad_fn in a
        # cycle that Python's collector cannot see through the C++ graph.
        held = _Held(t.detach())
        self._take(key)
        weakref.finalize(held, self._drop, key)
        return held

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed  # type: ignore[return-value]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Within this block, what autograd saves is counted while it is kept."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def simulated_peak(
    actions: Iterable[Action],
    split_backward: bool,
    forward: dict[tuple[int, int], int],
    at_backward: dict[tuple[int, int], int],
) -> int:
    """The most bytes held over ``actions`` (in the order run) when each (stage,
    micro-batch) holds ``forward``'s bytes from its F until the last of its B / W and, under
    a split backward, changes that by ``at_backward``'s bytes from its B until its W."""
    held = peak = 0
    for action in actions:
        key = action.stage, action.microbatch
        if action.kind == F:
            held += forward.get(key, 0)
        elif action.kind == B and not split_backward:
            held -= forward.get(key, 0)
        elif action.kind == B:
            held += at_backward.get(key, 0)
        else:
            held -= forward.get(key, 0) + at_backward.get(key, 0)
        peak = max(peak, held)
    return peak


class TensorMemory(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Bytes of tensor storages created inside the block and still alive: ``current`` and
    ``peak``.

    Every new storage an operator returns (not a view of, or an in-place result on, one of
    its inputs) is counted until it is freed, including storages only autograd's saved
    tensors keep alive, received activations and temporaries; tensors that existed before
    the block (parameters, existing ``.grad``) are not. For CPU runs, which have no
    allocator statistics; on CUDA ``torch.cuda.max_memory_allocated`` says the same.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and _counted(t)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _counted(t):
                storage = t.untyped_storage()
                key, size = id(storage), storage.nbytes()
                if size == 0 or key in self._live or storage.data_ptr() in inputs:
                    continue
                self._live[key] = size
                self.current += size
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


def _counted(t: torch.Tensor) -> bool:
    # A tensor subclass (a DTensor) has no storage of its own: its local tensors are
    # counted when the ops on them pass through.
    plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter
    return plain and t.layout == torch.strided and t.device.type != "meta"
