"""How a value gets from the stage that made it to the stage that uses it.

One interface, two implementations: :class:`Mailbox` hands values over in memory (every
consumer is in this process), :class:`Remote` also moves them between ranks with
:class:`~conveyor.runtime.transport.Transport`, posting exactly what each
:class:`~conveyor.runtime.program.Tick` says (see :mod:`conveyor.runtime.program` for why
that order cannot deadlock under NCCL).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from conveyor.context import Context
from conveyor.errors import PipelineError
from conveyor.runtime.program import Message, Tick, consumer_stage
from conveyor.runtime.timing import Timing
from conveyor.runtime.transport import Op, Transport, Work
from conveyor.runtime.wire import (
    HEADER_BYTES,
    TensorMeta,
    ValueMeta,
    decode_header,
    describe,
    encode_header,
    rebuild,
)
from conveyor.schedules import Action, F, Schedule

# (signature of the step's input shapes, mode): descriptions are cached per key.
StepKey = tuple[int, str]


def action_name(action: Action) -> str:
    """``F(stage 1, micro-batch 3)``."""
    return f"{action.kind}(stage {action.stage}, micro-batch {action.microbatch})"


def fresh_leaf(x: Any) -> Any:
    """A stage-input leaf cut from the producer's graph (gradients stop at the boundary)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


class Mailbox:
    """Every stage in this process: values are handed over in memory."""

    def __init__(self, schedule: Schedule, stages: set[int] | dict[int, Any]) -> None:
        self.schedule = schedule
        self.stages = set(stages)
        self.waits: list[Timing] = []
        self._box: dict[Action, Any] = {}

    def knows(self, key: StepKey) -> bool:
        """Whether a step of ``key`` ran to its end before: every value's description
        is known."""
        return False

    def begin(self, key: StepKey, t0: float) -> None:
        """Start a step (``t0``: its start on ``time.perf_counter``)."""
        self._box = {}
        self.waits = []

    def agree(self, header: torch.Tensor, has_inputs: bool) -> list[int]:
        """The step's header (input signature, micro-batch rows and counts: int64) as every
        pipeline rank sees it (the first stage's), read to the host: the step's one sync
        before its work."""
        return [int(v) for v in header.tolist()]

    def expect_sums(self) -> None:
        """The step's transfers are all posted: get ready for the loss sums (:meth:`share`)."""

    def share(self, sums: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The loss sums of the last stage (:func:`~conveyor.runtime.step_loss.pack`) for
        every pipeline rank: a call that returns them once they are here."""
        return lambda: sums

    def deliver(self, producer: Action, value: Any) -> None:
        """``producer``'s result (F output or B input gradients), for its consumer."""
        if producer.kind == F and isinstance(value, torch.Tensor):
            value = fresh_leaf(value)
        elif producer.kind == F:
            value = pytree.tree_map(fresh_leaf, value)
        self._box[producer] = value

    def take(self, producer: Action, consumer: Action) -> Any:
        """``producer``'s result, for ``consumer``."""
        return self._box.pop(producer)

    def post(self, tick: Tick, recvs: bool = True, sends: bool = True) -> None:
        """Post ``tick``'s transfers, its receives unless not ``recvs`` and its sends
        unless not ``sends``, as one group (none: nothing leaves this process)."""

    def end(self) -> None:
        """Finish the step's transfers."""


class _Incoming:
    """A message whose tensors are being received."""

    __slots__ = ("message", "meta", "tensors", "works")

    def __init__(self, message: Message, meta: ValueMeta | None) -> None:
        self.message = message
        self.meta = meta
        self.tensors: list[torch.Tensor] = []
        self.works: list[Work] = []


class Remote(Mailbox):
    """Values to stages of this process in memory, to other ranks over the wire.

    F outputs travel as their tensors plus, the first time a (step signature, producer)
    is seen, a fixed-size description; B input gradients need none (their shapes are
    those of the receiver's saved outputs, given by ``gradient_metas``).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: set[int] | dict[int, Any],
        ctx: Context,
        gradient_metas: Callable[[Action], list[TensorMeta]],
    ) -> None:
        super().__init__(schedule, stages)
        self.ctx = ctx
        self.rank = ctx.pp_rank
        self.device = ctx.device
        self.transport = Transport(self.rank, ctx.global_rank, ctx.device, ctx.timeout)
        self._gradient_metas = gradient_metas
        self._key: StepKey = (0, "train")
        self._t0 = 0.0
        self._outgoing: dict[Action, Any] = {}  # outputs computed, their sends not posted
        self._incoming: dict[Action, _Incoming] = {}
        self._sums: tuple[torch.Tensor, Work] | None = None  # the loss sums' receive
        self._known: set[StepKey] = set()  # keys of steps that ran to their end
        self._sent: dict[tuple[StepKey, Action], ValueMeta] = {}
        self._seen: dict[tuple[StepKey, Action], ValueMeta] = {}
        self._consumer: dict[Action, int | None] = {}  # producer -> its consumer's stage

    def begin(self, key: StepKey, t0: float) -> None:
        super().begin(key, t0)
        self._key, self._t0 = key, t0
        self._outgoing = {}
        self._incoming = {}

    def agree(self, header: torch.Tensor, has_inputs: bool) -> list[int]:
        """The first stage's holder sends its header to every other pipeline rank (not
        waited for: it starts its work at once), which waits for it."""
        holder = self.schedule.placement[0]
        if self.rank == holder and not has_inputs:
            raise PipelineError(
                f"rank {self.rank} holds the first stage but got inputs=None; pass the batch "
                f"on this rank"
            )
        if self.rank == holder:
            what = "sending the batch's shapes (the step's start)"
            others = [r for r in range(self.schedule.ranks) if r != holder]
            self.transport.post([Op(True, header, r, what) for r in others])
            return [int(v) for v in header.tolist()]
        buf = torch.empty_like(header)
        (work,) = self.transport.post([Op(False, buf, holder)])
        what = "waiting for the batch's shapes (the step's start)"
        self.transport.wait(work, holder, what)
        return [int(v) for v in buf.tolist()]  # one host sync per step, not per micro-batch

    def expect_sums(self) -> None:
        """Post the receive of the loss sums right after the step's last transfers, as a
        group of its own: they arrive while this rank still computes, and the holder's
        send finds its receive already posted."""
        holder = self.schedule.placement[-1]
        if self.rank != holder:
            buf = torch.empty(4, dtype=torch.float64, device=self.device)
            (work,) = self.transport.post([Op(False, buf, holder)])
            self._sums = (buf, work)

    def share(self, sums: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The last stage's holder sends ``sums`` to every other pipeline rank, which
        receive them (posted by :meth:`expect_sums`); the returned call waits for the
        transfer."""
        holder = self.schedule.placement[-1]
        if self.rank == holder:
            what = "sending the step's loss"
            others = [r for r in range(self.schedule.ranks) if r != holder]
            self.transport.post([Op(True, sums, r, what) for r in others])

            def sent() -> torch.Tensor:
                # Waited within the step: a send left pending past the last step would be
                # lost when the process exits.
                self.transport.flush()
                return sums

            return sent
        if self._sums is None:
            self.expect_sums()
        assert self._sums is not None
        (buf, work), self._sums = self._sums, None

        def received() -> torch.Tensor:
            self.transport.wait(work, holder, "waiting for the step's loss (the last stage)")
            return buf

        return received

    def deliver(self, producer: Action, value: Any) -> None:
        consumers = self._consumer
        if producer in consumers:
            consumer = consumers[producer]
        else:
            consumer = consumers[producer] = consumer_stage(producer, self.schedule.stages)
        if consumer in self.stages:
            super().deliver(producer, value)
        else:
            self._outgoing[producer] = value

    def take(self, producer: Action, consumer: Action) -> Any:
        if producer.stage in self.stages:
            return super().take(producer, consumer)
        incoming = self._incoming.pop(producer, None)
        if incoming is None:
            raise PipelineError(
                f"rank {self.rank}: {action_name(consumer)} needs {action_name(producer)}, "
                f"which no tick of this rank's program receives; the schedule is inconsistent"
            )

        def what() -> str:
            kind = "activations" if producer.kind == F else "gradients"
            return f"{action_name(consumer)} waiting for {kind} of {action_name(producer)}"

        works, src = incoming.works, incoming.message.src
        began = time.perf_counter()
        for work in works if len(works) == 1 else dict.fromkeys(works):  # NCCL: one a group
            self.transport.wait(work, src, what)
        ended = time.perf_counter()
        if ended - began > 1e-5:  # a real wait, not an already finished receive
            self.waits.append(
                Timing(
                    self.rank,
                    producer.kind,
                    producer.stage,
                    producer.microbatch,
                    began - self._t0,
                    ended - self._t0,
                )
            )
        if producer.kind != F:
            return incoming.tensors
        meta = incoming.meta
        assert meta is not None
        train = self._key[1] == "train"
        tensors = incoming.tensors
        for t, m in zip(tensors, meta.tensors, strict=True):
            if m.requires_grad and train:
                t.requires_grad_()
        return rebuild(meta, tensors)

    def post(self, tick: Tick, recvs: bool = True, sends: bool = True) -> None:
        descriptions: list[Op] = []
        ops: list[Op] = []
        for message in tick.sends if sends else ():
            ops += self._outgoing_ops(message, descriptions)
        self._post_group(tick.recvs if recvs else (), descriptions, ops)
        self.transport.prune()

    def _post_group(
        self, recvs: tuple[Message, ...], descriptions: list[Op], sends: list[Op]
    ) -> None:
        """Post ``recvs`` (in the program's order, which the senders' groups share) with
        ``sends`` as one group; new descriptions go first, as their
        own group with ``descriptions`` (outgoing ones), and are read before the tensors'
        buffers are sized."""
        unknown: list[tuple[Message, torch.Tensor]] = []
        for message in recvs:
            if message.producer.kind == F and self._meta(message) is None:
                buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                unknown.append((message, buf))
                descriptions.append(Op(False, buf, message.src))
        if descriptions:
            works = self.transport.post(descriptions)
            received = works[len(descriptions) - len(unknown) :]
            for (message, buf), work in zip(unknown, received, strict=True):
                what = f"waiting for the output description of {action_name(message.producer)}"
                self.transport.wait(work, message.src, what)
                self._seen[self._key, message.producer] = decode_header(self._host(buf))
        # One group: the sends, then the receives. The order inside a group decides no
        # deadlock (NCCL progresses a group's operations together), but on gloo each op
        # is posted in turn, and a peer that already waits for a send (its receive went
        # ahead: program rules 3 and 7) waits through every receive posted before it.
        # (benchmarks/recv_order.py finds no difference where both ends post at once.)
        receives: list[_Incoming] = []
        ops: list[Op] = []
        for message in recvs:
            if message.producer.kind == F:
                meta = self._meta(message)
                assert meta is not None
                metas = meta.tensors
            else:
                meta, metas = None, self._gradient_metas(message.producer)
            incoming = _Incoming(message, meta)
            for m in metas:
                t = torch.empty(m.shape, dtype=m.dtype, device=self.device)
                incoming.tensors.append(t)
                ops.append(Op(False, t, message.src))
            receives.append(incoming)
        works = self.transport.post(sends + ops)
        position = len(sends)
        for incoming in receives:
            n = len(incoming.tensors)
            incoming.works = works[position : position + n]
            position += n
            self._incoming[incoming.message.producer] = incoming

    def knows(self, key: StepKey) -> bool:
        return key in self._known

    def end(self) -> None:
        self._known.add(self._key)
        self.transport.flush()
        if self._incoming:
            left = ", ".join(action_name(p) for p in self._incoming)
            raise PipelineError(f"rank {self.rank}: received but never used: {left}")

    def _meta(self, message: Message) -> ValueMeta | None:
        return self._seen.get((self._key, message.producer))

    def _outgoing_ops(self, message: Message, descriptions: list[Op]) -> list[Op]:
        """The send of ``message``'s value; its description is added to
        ``descriptions`` when the receiver has not seen it."""
        producer = message.producer
        if producer not in self._outgoing:
            raise PipelineError(
                f"rank {self.rank}: the program sends {action_name(producer)}, which has not "
                f"run yet; the schedule is inconsistent"
            )
        value = self._outgoing.pop(producer)
        where = _where(producer)
        if producer.kind != F:
            gradients = lambda: f"sending input gradients of {where()}"  # noqa: E731
            return [Op(True, g.contiguous(), message.dst, gradients) for g in value]
        meta, tensors = describe(value)
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise PipelineError(
                    f"{where()} returned tensor {i} of its output on {t.device}, but this "
                    f"rank's device is {self.device}; move it with "
                    f".to({str(self.device)!r}) in the stage"
                )
        known = self._sent.get((self._key, producer))
        if known is None:
            header = encode_header(meta, where())
            if self.device.type == "cuda":  # pinned: the copy does not sync the host
                header = header.pin_memory().to(self.device, non_blocking=True)
            else:
                header = header.to(self.device)
            what = f"sending output description of {where()}"
            descriptions.append(Op(True, header, message.dst, what))
            self._sent[self._key, producer] = meta
        elif known != meta:
            raise PipelineError(
                f"{where()} output changed ({_difference(known, meta)}) although the input "
                f"shapes did not; stage outputs must be tensors whose shapes follow the "
                f"inputs (return varying non-tensor values from the last stage only)"
            )
        output = lambda: f"sending output of {where()}"  # noqa: E731
        return [Op(True, t, message.dst, output) for t in tensors]

    def _host(self, buf: torch.Tensor) -> torch.Tensor:
        """A received description on the host (CUDA: through pinned memory)."""
        if buf.device.type != "cuda":
            return buf
        host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        host.copy_(buf, non_blocking=True)
        torch.cuda.current_stream(buf.device).synchronize()
        if self.transport.watchdog is not None:
            self.transport.watchdog.check()
        return host


def _where(producer: Action) -> Callable[[], str]:
    """``producer``'s place in words, ``stage 1 (micro-batch 3)``, made when asked."""
    return lambda: f"stage {producer.stage} (micro-batch {producer.microbatch})"


def _difference(old: ValueMeta, new: ValueMeta) -> str:
    if old.spec != new.spec:
        return "its structure"
    for i, (a, b) in enumerate(zip(old.leaves, new.leaves, strict=True)):
        if a != b:
            before = f"{a[1]!r}" if isinstance(a, tuple) else f"tensor {a.shape} {a.dtype}"
            after = f"{b[1]!r}" if isinstance(b, tuple) else f"tensor {b.shape} {b.dtype}"
            return f"output value {i} was {before}, now {after}"
    return "its description"
