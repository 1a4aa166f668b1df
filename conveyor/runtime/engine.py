"""Executes a :class:`Schedule`'s actions for the stages this process holds.

In a distributed world a process runs its pipeline rank's program; in the world of one
process it runs every rank's program interleaved in a valid global order. Values between
stages held by the same process are handed over in memory; others go through
:class:`Transport`, with receives posted ahead in the order the sender sends them (so the
same code is correct on NCCL, which matches by order, and gloo, which matches by tag).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.context import Context
from conveyor.errors import PipelineError
from conveyor.partition.describe import shape_of
from conveyor.runtime.call import StageCaller
from conveyor.runtime.deferred_linear import LinearWeightStore
from conveyor.runtime.memory import ActivationMeter, MemoryReport, simulated_peak
from conveyor.runtime.recompute import (
    RngState,
    discard_saved,
    replay_rng,
    rng_state,
    shape_only,
)
from conveyor.runtime.sharding import Sharded
from conveyor.runtime.split_backward import WeightWork, backward_input
from conveyor.runtime.transport import Transport, Work, collective
from conveyor.runtime.wire import (
    HEADER_BYTES,
    TensorMeta,
    ValueMeta,
    decode_header,
    describe,
    encode_header,
    rebuild,
)
from conveyor.schedules import Action, B, F, Schedule, W, execution_order
from conveyor.trace import Timing

Mode = Literal["train", "eval", "predict"]
LossFn = Callable[[Any, Any], torch.Tensor] | None

# How many upcoming actions get their receives posted before they run.
LOOKAHEAD = 3
_TAG_SLOTS = 1024  # per-message tag space: tensor index; the last slot is the header


@dataclass
class _Recv:
    """A message being received: posted header and/or tensor receives."""

    peer: int
    producer: Action
    meta: ValueMeta | None = None
    header: torch.Tensor | None = None
    header_work: Work | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    works: list[Work] = field(default_factory=list)


@dataclass
class _Plan:
    """The static part of running one mode: program and who sends what, in which order."""

    program: list[tuple[int, Action]]
    remote_input: list[Action | None]  # per program index: the remote message it consumes
    first: dict[int, int]  # per local stage: the index of its first action
    last: dict[int, int]  # per local stage: the index of its last action
    incoming: dict[int, list[Action]]  # per peer: producers of messages to us, in send order
    # (stage, micro-batch) whose B comes right after its F: recompute would free nothing.
    adjacent: frozenset[tuple[int, int]] = frozenset()


def _grad_leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor) and x.requires_grad]


class Engine:
    """Runs train / eval / predict steps of one schedule over this process's stages."""

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, nn.Module],
        loss_fn: LossFn,
        ctx: Context,
        *,
        recompute: frozenset[int] = frozenset(),
        autocast: torch.dtype | None = None,
        track_memory: bool = False,
        sharded: Sharded | None = None,
    ) -> None:
        """``recompute``: global indices of stages whose forward is re-run at B instead of
        keeping its activations; ``autocast``: the dtype stage forwards run under
        ``torch.autocast`` (None: as the model is); ``track_memory``: measure the activation
        memory of every step (:class:`~conveyor.runtime.memory.ActivationMeter`);
        ``sharded``: FSDP on these stages, gathered before each stage's first action of a
        step and reduced after its last (:class:`~conveyor.runtime.sharding.Sharded`)."""
        self.sharded = sharded
        # Multiplies every micro-batch's loss before its backward (not the loss reported):
        # FSDP's mean over replicas then weighs replicas by their shard of the batch.
        self.loss_scale = 1.0
        self.schedule = schedule
        self.stages = stages
        self.loss_fn = loss_fn
        self.ctx = ctx
        self.recompute = frozenset(s for s in recompute if s in stages)
        self.autocast = autocast
        # Neither option: the forward runs exactly the original, option-free code.
        self._plain = not self.recompute and autocast is None
        self.device = ctx.device
        self.last = schedule.stages - 1
        self.rank = ctx.pp_rank
        self.transport = (
            Transport(self.rank, ctx.global_rank, ctx.device, ctx.timeout)
            if ctx.distributed
            else None
        )
        self._params: dict[int, list[torch.Tensor]] = {
            s: [p for p in stage.parameters() if p.requires_grad] for s, stage in stages.items()
        }
        self._store = LinearWeightStore([p for ps in self._params.values() for p in ps])
        self._call = StageCaller()
        self.meter = (
            ActivationMeter(p for stage in stages.values() for p in stage.parameters())
            if track_memory
            else None
        )
        self.memory: MemoryReport | None = None
        # Per stage held here: 'dtype[shape]' of each value its first forward sent on.
        self.sent_shapes: dict[int, list[str]] = {}
        self._plans: dict[bool, _Plan] = {}
        self._sent: dict[tuple[int, str, Action], ValueMeta] = {}
        self._seen: dict[tuple[int, str, Action], ValueMeta] = {}
        self.timings: list[Timing] = []
        # (rank, "F" or "B" of the producer waited for, its stage, micro-batch, start, end)
        self.waits: list[Timing] = []
        # Called after each action of a step (after a fused run of W, with each of them):
        # data parallelism starts reducing a stage's gradients after its last B / W.
        self.after_action: Callable[[Action], None] | None = None

    # ----------------------------------------------------------------- planning
    def _plan(self, train: bool) -> _Plan:
        plan = self._plans.get(train)
        if plan is not None:
            return plan
        sched = self.schedule

        def keep(a: Action) -> bool:
            return train or a.kind == F

        if self.transport is None:
            program = [(r, a) for r, a in execution_order(sched) if keep(a)]
            plan = _Plan(program, [None] * len(program), *_ends(program), {})
        else:
            program = [(self.rank, a) for a in sched.actions[self.rank] if keep(a)]
            remote = [self._remote_producer(a) for _, a in program]
            incoming: dict[int, list[Action]] = {}
            for peer, peer_program in enumerate(sched.actions):
                if peer == self.rank:
                    continue
                sent = [a for a in peer_program if keep(a) and self._consumer_rank(a) == self.rank]
                if sent:
                    incoming[peer] = sent
            plan = _Plan(program, remote, *_ends(program), incoming)
        plan.adjacent = frozenset(
            (a.stage, a.microbatch)
            for (_, a), (_, b) in itertools.pairwise(plan.program)
            if a.kind == F and b.kind == B and (a.stage, a.microbatch) == (b.stage, b.microbatch)
        )
        self._plans[train] = plan
        return plan

    def _consumer_rank(self, producer: Action) -> int | None:
        """The rank that consumes ``producer``'s output, or None if nothing is sent."""
        if producer.kind == F and producer.stage < self.last:
            return self.schedule.placement[producer.stage + 1]
        if producer.kind == B and producer.stage > 0:
            return self.schedule.placement[producer.stage - 1]
        return None

    def _producer(self, action: Action) -> Action | None:
        if action.kind == F and action.stage > 0:
            return Action(F, action.stage - 1, action.microbatch)
        if action.kind == B and action.stage < self.last:
            return Action(B, action.stage + 1, action.microbatch)
        return None

    def _remote_producer(self, action: Action) -> Action | None:
        producer = self._producer(action)
        if producer is None or producer.stage in self.stages:
            return None
        return producer

    def _tag(self, producer: Action, index: int) -> int:
        kind = 0 if producer.kind == F else 1
        base = (producer.stage * 2 + kind) * self.schedule.microbatches + producer.microbatch
        return base * _TAG_SLOTS + index

    # ----------------------------------------------------------------- one step
    def run(
        self,
        mode: Mode,
        inputs: list[Any] | None,
        targets: list[Any] | None,
    ) -> tuple[torch.Tensor | None, list[Any]]:
        """Run one step; returns (this process's summed weighted loss or None, outputs).

        ``inputs``/``targets`` are per micro-batch (None where this process holds neither
        the first nor the last stage, and targets always None when the model computes its
        own loss). Each micro-batch's loss is weighted by its share of the batch. Outputs
        are the last stage's micro-batch outputs in ``predict`` mode.
        """
        train = mode == "train"
        plan = self._plan(train)
        self._adjacent = plan.adjacent
        self._mode: Mode = mode
        self._train = train
        self._sig, size = self._agree_signature(inputs)
        m = self.schedule.microbatches
        self._weights = [(size // m + (1 if i < size % m else 0)) / size for i in range(m)]
        self._inputs, self._targets = inputs, targets
        self._mailbox: dict[Action, Any] = {}
        self._saved: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._recvs: dict[Action, _Recv] = {}
        self._cursor = dict.fromkeys(plan.incoming, 0)
        self._weights_pending: dict[tuple[int, int], WeightWork] = {}
        # Recompute stages: (stage input, RNG state) per (stage, micro-batch), from F to B.
        self._stash: dict[tuple[int, int], tuple[Any, RngState]] = {}
        self._outputs: dict[int, Any] = {}
        self._loss: torch.Tensor | None = None
        timings: list[Timing] = []
        clock = time.perf_counter
        t0 = self._t0 = clock()  # after the signature broadcast: ranks start together
        self._waits: list[Timing] = []
        program = plan.program
        meter = self.meter if train else None
        self._forward_bytes: dict[tuple[int, int], int] = {}
        self._backward_bytes: dict[tuple[int, int], int] = {}
        if meter is not None:
            meter.reset()
        if self.sharded is not None:
            self.sharded.begin(sorted(plan.first, key=plan.first.__getitem__), train)
        with (
            torch.set_grad_enabled(train),
            meter.hooks() if meter is not None else contextlib.nullcontext(),
        ):
            i = 0
            while i < len(program):
                rank, action = program[i]
                if self.transport is not None:
                    self._post_ahead(plan, i)
                if self.sharded is not None and plan.first[action.stage] == i:
                    self._gathered(action.stage)
                self._start = clock()  # moved past any wait for inputs by _take
                if action.kind == W:
                    # Consecutive W of one stage run as one: a GEMM per weight, not per W.
                    j = i + 1
                    while j < len(program) and program[j][1][:2] == (W, action.stage):
                        j += 1
                    self._weight_gradients(action.stage, [a.microbatch for _, a in program[i:j]])
                    share = (clock() - self._start) / (j - i)
                    for k, (_, a) in enumerate(program[i:j]):
                        start = self._start - t0 + k * share
                        timings.append((rank, W, a.stage, a.microbatch, start, start + share))
                        if self.after_action is not None:
                            self.after_action(a)
                    if self.sharded is not None and plan.last[action.stage] < j:
                        self.sharded.finish(action.stage, train)
                    i = j
                    continue
                if action.kind == F:
                    if meter is None:
                        self._forward(action)
                    else:
                        before = meter.taken
                        self._forward(action)
                        self._forward_bytes[action.stage, action.microbatch] = meter.taken - before
                elif meter is None or not self.schedule.split_backward:
                    self._backward(action)
                else:
                    before = meter.current
                    self._backward(action)
                    self._backward_bytes[action.stage, action.microbatch] = meter.current - before
                timings.append(
                    (
                        rank,
                        action.kind,
                        action.stage,
                        action.microbatch,
                        self._start - t0,
                        clock() - t0,
                    )
                )
                if self.after_action is not None:
                    self.after_action(action)
                if self.sharded is not None and plan.last[action.stage] == i:
                    self.sharded.finish(action.stage, train)
                i += 1
        if self.transport is not None:
            self.transport.flush()
        if train:  # traces and measurements show the last training step, not a predict
            self.timings = timings
            self.waits = self._waits
        if meter is not None:
            forward = self._forward_bytes
            order = [a for _, a in program]
            changes = self._backward_bytes
            peak = simulated_peak(order, self.schedule.split_backward, forward, changes)
            self.memory = MemoryReport(meter.peak, forward, changes, peak)
        if self._saved or self._weights_pending:
            left = ", ".join(
                f"stage {s} micro-batch {m}" for s, m in [*self._saved, *self._weights_pending]
            )
            raise PipelineError(
                f"rank {self.rank}: activations never consumed by a backward: {left}"
            )
        outputs = [self._outputs[m] for m in sorted(self._outputs)]
        return self._loss, outputs

    def _gathered(self, stage: int) -> None:
        """FSDP: wait for ``stage``'s parameters; the gathered tensors are what autograd
        sees this step, so the split backward and the meter work on them."""
        assert self.sharded is not None
        self.sharded.ready(stage)
        params: list[torch.Tensor] = [p for p in self.stages[stage].parameters() if p.requires_grad]
        self._params[stage] = params
        self._store.add_params(params)
        if self.meter is not None:
            self.meter.exclude(params)

    def _agree_signature(self, inputs: list[Any] | None) -> tuple[int, int]:
        """A number all ranks share that changes when micro-batch input shapes change, and
        the batch size (micro-batch losses are weighted by their share of it)."""
        sig = size = 0
        if inputs is not None:
            shapes = [
                (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
                for mb in inputs
                for x in pytree.tree_leaves(mb)
            ]
            sig = zlib.crc32(repr(shapes).encode())
            size = sum(_batch_size(mb) for mb in inputs)
        if self.transport is None:
            return sig, size
        holder = self.schedule.placement[0]
        if self.rank == holder and inputs is None:
            raise PipelineError(
                f"rank {self.rank} holds the first stage but got inputs=None; pass the batch "
                f"on this rank"
            )
        buf = torch.tensor([sig, size], dtype=torch.int64, device=self.device)
        assert self.transport is not None
        transport = self.transport
        others = [transport.name(r) for r in range(self.schedule.ranks) if r != self.rank]
        if self.rank == holder:
            doing = "sending the batch's shapes to " + ", ".join(others)
            suspect = " or ".join(others)
        else:
            doing = f"receiving the batch's shapes from {transport.name(holder)} (stage 0)"
            suspect = f"{transport.name(holder)} or another pipeline rank"
        collective(
            lambda: dist.broadcast(
                buf, self.ctx.global_rank(holder), group=self.ctx.pp_group, async_op=True
            ),
            self.ctx.timeout,
            f"{transport.name(self.rank)}: starting a step ({doing})",
            suspect,
        )
        return int(buf[0]), int(buf[1])

    # ----------------------------------------------------------------- compute
    def _forward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        if s == 0:
            assert self._inputs is not None
            value = self._inputs[m]
            in_leaves: list[torch.Tensor] = []
            if self._train and self.schedule.split_backward:
                # Track the input's gradient (then dropped) so that B, not W, walks the
                # stage's input path: the first stage's B and W then cost what the
                # schedule assumes of every stage, instead of B nothing and W everything.
                value = pytree.tree_map(_track_float, value)
                in_leaves = _grad_leaves(value)
        else:
            value = self._take(Action(F, s - 1, m), action)
            in_leaves = _grad_leaves(value) if self._train else []
        scaled: torch.Tensor | None = None
        if not self._plain:
            out, scaled = self._forward_with_options(s, m, value)
        elif self._train and self.schedule.split_backward:
            with self._store.capture((s, m)):
                out = self._call(s, self.stages[s], value, s == 0)
        else:
            out = self._call(s, self.stages[s], value, s == 0)
        if s < self.last:
            if s not in self.sent_shapes:
                values = out if isinstance(out, tuple) else (out,)
                self.sent_shapes[s] = [shape_of(v) for v in values]
            if self._train:
                outs = _grad_leaves(out)
                if self._stash and (s, m) in self._stash:  # recomputed at B: shapes only
                    outs = [shape_only(t) for t in outs]
                self._saved[(s, m)] = (in_leaves, outs)
            self._deliver(action, out)
            return
        if self._mode == "predict":
            self._outputs[m] = pytree.tree_map(
                lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out
            )
            return
        if scaled is None:
            scaled = self._scaled_loss(out, m)
        total = scaled.detach() / self.loss_scale
        self._loss = total if self._loss is None else self._loss + total
        if self._train:
            # A recomputed last stage keeps nothing: B recomputes the loss too.
            recomputed = self._stash and (s, m) in self._stash
            self._saved[(s, m)] = (in_leaves, [] if recomputed else [scaled])

    def _scaled_loss(self, out: Any, m: int) -> torch.Tensor:
        """The micro-batch's loss times its share of the batch."""
        if self.loss_fn is None:
            loss = model_loss(out)
        else:
            assert self._targets is not None
            loss = self.loss_fn(out, self._targets[m])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise PipelineError(
                f"loss_fn must return a scalar tensor (the mean loss of the micro-batch), got {got}"
            )
        return loss.reshape(()) * (self._weights[m] * self.loss_scale)

    def _forward_with_options(self, s: int, m: int, value: Any) -> tuple[Any, torch.Tensor | None]:
        """F under autocast and/or recompute; returns the output and, on the last stage
        (outside predict), the scaled loss, computed under the same autocast."""
        recompute = self._train and s in self.recompute and (s, m) not in self._adjacent
        if recompute:
            self._stash[(s, m)] = (value, rng_state(self.device))
            if self.meter is not None:  # the kept input is what recompute holds
                self.meter.track(
                    [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
                )
        capture = self._train and self.schedule.split_backward and not recompute
        scaled = None
        with contextlib.ExitStack() as stack:
            if self.autocast is not None:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
            if recompute:
                # Build the graph (outputs know which of them need gradients), save nothing.
                stack.enter_context(discard_saved())
            with self._store.capture((s, m)) if capture else contextlib.nullcontext():
                out = self._call(s, self.stages[s], value, s == 0)
            if s == self.last and self._mode != "predict":
                scaled = self._upcast(self._scaled_loss(out, m))
        return out, scaled

    def _rerun(self, s: int, m: int) -> list[torch.Tensor]:
        """B of a recompute stage: its forward again, from the kept input and RNG state;
        returns the outputs to differentiate."""
        value, rng = self._stash.pop((s, m))
        split = self.schedule.split_backward
        with contextlib.ExitStack() as stack:
            stack.enter_context(replay_rng(rng, self.device))
            if self.autocast is not None:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
            with self._store.capture((s, m)) if split else contextlib.nullcontext():
                out = self._call(s, self.stages[s], value, s == 0)
            if s == self.last:
                return [self._upcast(self._scaled_loss(out, m))]
        return _grad_leaves(out)

    def _upcast(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss computed in the autocast dtype, in float32 (micro-batch losses add up)."""
        return loss.float() if self.autocast is not None and loss.dtype == self.autocast else loss

    def _backward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        # Receive first: posting the gradient receive reads the saved outputs' shapes.
        grads = None if s == self.last else self._take(Action(B, s + 1, m), action)
        in_leaves, outs = self._saved.pop((s, m))
        if self._stash and (s, m) in self._stash:
            outs = self._rerun(s, m)
        if self.schedule.split_backward:
            got, work = backward_input(outs, grads, in_leaves, self._params[s])
            self._weights_pending[(s, m)] = work
            # Free what only B needed (W holds its own references) before anything else.
            del outs
            if self.meter is not None:
                self.meter.track(self._store.kept((s, m)))  # held until W
        else:
            if outs:
                torch.autograd.backward(outs, grads)
            got = [x.grad for x in in_leaves]
        if s > 0:
            grads_in = [
                g if g is not None else torch.zeros_like(x)
                for g, x in zip(got, in_leaves, strict=True)
            ]
            self._deliver(action, grads_in)

    def _weight_gradients(self, stage: int, microbatches: list[int]) -> None:
        for m in microbatches:
            self._weights_pending.pop((stage, m)).run()
        self._store.flush([(stage, m) for m in microbatches])

    # ----------------------------------------------------------------- transfers
    def _deliver(self, producer: Action, value: Any) -> None:
        consumer = self._consumer_rank(producer)
        assert consumer is not None
        next_stage = producer.stage + (1 if producer.kind == F else -1)
        if next_stage in self.stages:
            if producer.kind == F:
                value = pytree.tree_map(_fresh_leaf, value)
            self._mailbox[producer] = value
            return
        assert self.transport is not None
        where = f"stage {producer.stage} (micro-batch {producer.microbatch})"
        if producer.kind == B:
            for i, g in enumerate(value):
                self.transport.send(
                    g.contiguous(),
                    consumer,
                    self._tag(producer, i),
                    f"sending input gradients of {where}",
                )
            self.transport.prune()
            return
        meta, tensors = describe(value)
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise PipelineError(
                    f"{where} returned tensor {i} of its output on {t.device}, but this rank's "
                    f"device is {self.device}; move it with .to({str(self.device)!r}) in the stage"
                )
        key = (self._sig, self._mode, producer)
        known = self._sent.get(key)
        if known is None:
            header = encode_header(meta, where).to(self.device)
            self.transport.send(
                header,
                consumer,
                self._tag(producer, _TAG_SLOTS - 1),
                f"sending output description of {where}",
            )
            self._sent[key] = meta
        elif known != meta:
            raise PipelineError(
                f"{where} output changed ({_difference(known, meta)}) although the input "
                f"shapes did not; stage outputs must be tensors whose shapes follow the inputs "
                f"(return varying non-tensor values from the last stage only)"
            )
        for i, t in enumerate(tensors):
            self.transport.send(t, consumer, self._tag(producer, i), f"sending output of {where}")
        self.transport.prune()

    def _take(self, producer: Action, consumer: Action) -> Any:
        if producer.stage in self.stages:
            return self._mailbox.pop(producer)
        assert self.transport is not None
        peer = self.schedule.placement[producer.stage]
        while producer not in self._recvs or self._recvs[producer].meta is None:
            if not self._post_next(peer, resolve=True):
                raise PipelineError(
                    f"rank {self.rank}: cannot receive {_name(producer)} for {_name(consumer)}; "
                    f"the schedule is inconsistent"
                )
        recv = self._recvs.pop(producer)
        kind = "activations" if producer.kind == F else "gradients"
        what = f"{_name(consumer)} waiting for {kind} of {_name(producer)}"
        began = time.perf_counter()
        for work in recv.works:
            self.transport.wait(work, peer, what)
        self._start = time.perf_counter()
        if self._start - began > 1e-5:  # a real wait, not an already finished receive
            self._waits.append(
                (
                    self.rank,
                    producer.kind,
                    producer.stage,
                    producer.microbatch,
                    began - self._t0,
                    self._start - self._t0,
                )
            )
        if producer.kind == B:
            return recv.tensors
        assert recv.meta is not None
        tensors = [
            t.requires_grad_(m.requires_grad and self._train)
            for t, m in zip(recv.tensors, recv.meta.tensors, strict=True)
        ]
        return rebuild(recv.meta, tensors)

    def _post_ahead(self, plan: _Plan, index: int) -> None:
        for j in range(index, min(index + LOOKAHEAD, len(plan.program))):
            producer = plan.remote_input[j]
            if producer is None or producer in self._recvs:
                continue
            peer = self.schedule.placement[producer.stage]
            while producer not in self._recvs and self._post_next(peer, resolve=False):
                pass

    def _post_next(self, peer: int, resolve: bool) -> bool:
        """Post the next message from ``peer`` in its send order; False if it must wait.

        A message whose description is still in flight blocks the ones after it (NCCL
        matches by order); with ``resolve`` we wait for that description instead.
        """
        assert self.transport is not None
        order = self._plans[self._train].incoming.get(peer, [])
        cursor = self._cursor.get(peer, 0)
        if cursor > 0:
            previous = self._recvs.get(order[cursor - 1])
            if previous is not None and previous.meta is None:
                if not resolve:
                    return False
                self._resolve_header(previous)
                return True
        if cursor >= len(order):
            return False
        producer = order[cursor]
        recv = _Recv(peer, producer)
        if producer.kind == B:
            saved = self._saved.get((producer.stage - 1, producer.microbatch))
            if saved is None:
                return False  # our forward has not run yet, so gradient shapes are unknown
            metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in saved[1]]
            self._post_tensors(recv, metas)
            recv.meta = ValueMeta(pytree.tree_flatten(None)[1], ())
        else:
            recv.meta = self._seen.get((self._sig, self._mode, producer))
            if recv.meta is None:
                recv.header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                recv.header_work = self.transport.recv(
                    recv.header, peer, self._tag(producer, _TAG_SLOTS - 1)
                )
            else:
                self._post_tensors(recv, recv.meta.tensors)
        self._recvs[producer] = recv
        self._cursor[peer] = cursor + 1
        return True

    def _resolve_header(self, recv: _Recv) -> None:
        assert self.transport is not None and recv.header is not None
        assert recv.header_work is not None
        self.transport.wait(
            recv.header_work,
            recv.peer,
            f"waiting for the output description of {_name(recv.producer)}",
        )
        meta = decode_header(recv.header)
        self._seen[(self._sig, self._mode, recv.producer)] = meta
        recv.header = recv.header_work = None
        self._post_tensors(recv, meta.tensors)
        recv.meta = meta

    def _post_tensors(self, recv: _Recv, metas: list[TensorMeta]) -> None:
        assert self.transport is not None
        for i, m in enumerate(metas):
            t = torch.empty(m.shape, dtype=m.dtype, device=self.device)
            recv.tensors.append(t)
            recv.works.append(self.transport.recv(t, recv.peer, self._tag(recv.producer, i)))


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model computed itself (``loss_fn=None``): its output if that is a scalar,
    else the output's ``loss`` (a ``ModelOutput`` / dict entry or attribute)."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise PipelineError(
            f"loss_fn=None takes the loss from the model's output, but its "
            f"{type(out).__name__} has no loss; pass what the model needs to compute one "
            f"(e.g. labels in the inputs dict), or give Pipeline a loss_fn"
        )
    return loss


def _batch_size(value: Any) -> int:
    leaves = [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor) and x.dim()]
    return int(leaves[0].shape[0]) if leaves else 1


def _ends(program: list[tuple[int, Action]]) -> tuple[dict[int, int], dict[int, int]]:
    """Per stage, the index of its first and of its last action in ``program``."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (_, a) in enumerate(program):
        first.setdefault(a.stage, i)
        last[a.stage] = i
    return first, last


def _name(action: Action) -> str:
    return f"{action.kind}(stage {action.stage}, micro-batch {action.microbatch})"


def _track_float(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_()
    return x


def _fresh_leaf(x: Any) -> Any:
    """A stage-input leaf cut from the producer's graph (gradients stop at the boundary)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _difference(old: ValueMeta, new: ValueMeta) -> str:
    if old.spec != new.spec:
        return "its structure"
    for i, (a, b) in enumerate(zip(old.leaves, new.leaves, strict=True)):
        if a != b:
            before = f"{a[1]!r}" if isinstance(a, tuple) else f"tensor {a.shape} {a.dtype}"
            after = f"{b[1]!r}" if isinstance(b, tuple) else f"tensor {b.shape} {b.dtype}"
            return f"output value {i} was {before}, now {after}"
    return "its description"
