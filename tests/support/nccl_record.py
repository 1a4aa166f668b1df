"""Record everything this process posts at the torch.distributed level (tests only).

Inside one worker process::

    with nccl_record.recording() as trace:
        ...  # run the program
    return trace  # a list of tests.support.nccl_model.Record, plain picklable data

and in the parent ``nccl_model.check(dict(enumerate(traces)))``.

Covered: ``isend``/``irecv``/``send``/``recv``, ``batch_isend_irecv`` (one batch id per
call; like NCCL, which coalesces the group, it returns ONE work for the whole group, done
when every op of it is, where gloo returns one per op: so the runtime's handling of NCCL's
answer runs under the replay too), the process-group collectives (including the object
collectives, recorded once at the outermost call), the functional collectives behind DTensor (the
``torch.ops._c10d_functional`` ops, seen by a TorchDispatchMode, and their
``wait_tensor``), and every ``Work.wait`` on a returned work (a thin proxy). Blocking calls
(``send``, ``recv``, ``async_op=False``) are recorded as the op followed by its wait.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.nccl_model import Record

Trace = list[Record]

P2P = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}
# collective -> the parameter whose tensor size is recorded (None: none is)
COLLECTIVES: dict[str, str | None] = {
    "broadcast": "tensor",
    "all_reduce": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "all_to_all_single": "input",
    "all_to_all": None,
    "gather": "tensor",
    "scatter": "tensor",
    "all_reduce_coalesced": None,
    "all_gather_coalesced": None,
    "_all_gather_base": "input_tensor",
    "_reduce_scatter_base": "input",
    "barrier": None,
    "monitored_barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
}

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_SITE = sysconfig.get_paths()["purelib"] + os.sep
_HERE = os.path.abspath(__file__)

_active: _Recorder | None = None
_originals: dict[str, Callable[..., Any]] = {}
_wrappers: dict[str, Callable[..., Any]] = {}


class _Recorder:
    """The trace being recorded, and what the wrappers need to fill it."""

    def __init__(self, library: str) -> None:
        self.trace: Trace = []
        # The library's own directory, and the folder holding it (the checkout): frames are
        # told apart by where the imported package lives, not by a folder's name, so a
        # checkout that is itself named like the library reports the same paths.
        package = importlib.import_module(library).__file__
        assert package is not None
        self.library = os.path.dirname(os.path.abspath(package)) + os.sep
        self.root = os.path.dirname(self.library.rstrip(os.sep)) + os.sep
        self.lock = threading.Lock()
        self.local = threading.local()
        self.batches = 0
        # functional collectives: output storage address -> the seqs wait_tensor waits for
        self.outputs: dict[int, tuple[int, ...]] = {}

    def busy(self) -> bool:
        """Inside a recorded call: what it calls internally is not recorded again."""
        return getattr(self.local, "depth", 0) > 0

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.local.depth = getattr(self.local, "depth", 0) + 1
        try:
            yield
        finally:
            self.local.depth -= 1

    def add(self, kind: str, name: str, **fields: Any) -> int:
        found = self.locate()
        with self.lock:
            seq = len(self.trace)
            rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
            self.trace.append(Record(rank=rank, seq=seq, kind=kind, name=name, **found, **fields))
            return seq

    def add_wait(self, seqs: tuple[int, ...], timeout_given: bool, name: str = "wait") -> None:
        self.add("wait", name, waits_on=seqs, timeout_given=timeout_given)

    def new_batch(self) -> int:
        with self.lock:
            self.batches += 1
            return self.batches - 1

    def locate(self) -> dict[str, Any]:
        """``where`` (innermost library frame), ``stack`` (up to 4 library frames,
        innermost first) and ``caller`` (innermost frame outside torch)."""
        frame: FrameType | None = sys._getframe(1)
        stack: list[str] = []
        caller = ""
        while frame is not None and len(stack) < 4:
            name = frame.f_code.co_filename
            skip = (
                name.startswith(("<", _TORCH))
                or name == _HERE
                or (name.startswith(_STDLIB) and not name.startswith(_SITE))
            )
            if not skip:
                text = self.format(frame, name)
                caller = caller or text
                if name.startswith(self.library):
                    stack.append(text)
            frame = frame.f_back
        return {"where": stack[0] if stack else "", "stack": tuple(stack), "caller": caller}

    def format(self, frame: FrameType, name: str) -> str:
        """``path:line in function``, the path relative to the checkout holding the library
        (else to the working directory, else absolute)."""
        if name.startswith(self.root):
            path = name[len(self.root) :]
        else:
            path = os.path.relpath(name) if name.startswith(os.getcwd() + os.sep) else name
        return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _group(group: Any) -> tuple[Any, dict[str, Any]]:
    """The process group (None: the default one) and its identity fields for a record."""
    pg = group if group is not None else c10d._get_default_group()
    return pg, {"group": pg.group_name, "members": tuple(dist.get_process_group_ranks(pg))}


def _tensor(t: Any) -> dict[str, Any]:
    if isinstance(t, torch.Tensor):
        return {
            "numel": t.numel(),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": tuple(t.shape),
        }
    if isinstance(t, (list, tuple)) and t and all(isinstance(x, torch.Tensor) for x in t):
        return {"numel": sum(x.numel() for x in t), "dtype": str(t[0].dtype).removeprefix("torch.")}
    return {}


class _Work(dist.Work):
    """A returned Work whose ``wait`` is recorded; everything else goes to the real one."""

    def __init__(self, work: dist.Work, seqs: tuple[int, ...]) -> None:
        super().__init__()
        self._work = work
        self._seqs = seqs

    def wait(self, timeout: Any = None) -> bool:
        rec = _active
        if rec is not None and not rec.busy():
            rec.add_wait(self._seqs, timeout is not None)
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def __getattr__(self, name: str) -> Any:
        if name == "_work":
            raise AttributeError(name)
        return getattr(self._work, name)


def _forward(name: str) -> Callable[..., Any]:
    def method(self: _Work, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._work, name)(*args, **kwargs)

    method.__name__ = name
    return method


# dist.Work's own (pybind) methods would shadow __getattr__: forward each explicitly.
for _name in dir(dist.Work):
    if not _name.startswith("__") and _name not in ("wait", "_pybind11_conduit_v1_"):
        setattr(_Work, _name, _forward(_name))


class _Coalesced(_Work):
    """The one work NCCL returns for a ``batch_isend_irecv`` group: waiting for it waits for
    every op of the group (recorded as one wait on all of them); it is completed when they
    all are. Other methods go to the first op's work."""

    def __init__(self, works: list[dist.Work], seqs: tuple[int, ...]) -> None:
        super().__init__(works[0], seqs)
        self._works = works
        self._done: set[int] = set()  # gloo's works: a second wait waits for another message

    def wait(self, timeout: Any = None) -> bool:
        rec = _active
        if rec is not None and not rec.busy():
            rec.add_wait(self._seqs, timeout is not None)
        for i, work in enumerate(self._works):
            if i not in self._done:
                if not (work.wait() if timeout is None else work.wait(timeout)):
                    return False
                self._done.add(i)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _wrap(work: Any, seqs: tuple[int, ...]) -> Any:
    return _Work(work, seqs) if isinstance(work, dist.Work) else work


def _bound(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[_Recorder, dict[str, Any]] | None:
    """The active recorder and the call's arguments by name, or None when the call is
    not to be recorded (no recording, inside a recorded call, unbindable, not a member)."""
    rec = _active
    if rec is None or rec.busy():
        return None
    try:
        given = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    if c10d._rank_not_in_group(given.get("group")):
        return None
    return rec, dict(given)


def _recorded(
    original: Callable[..., Any], handle: Callable[[_Recorder, dict[str, Any], Any], Any]
) -> Callable[..., Any]:
    """``original`` that, while recording, runs as a recorded call and passes its
    arguments and result to ``handle``, which records it and returns what to return."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = _bound(signature, args, kwargs)
        if bound is None:
            return original(*args, **kwargs)
        rec, given = bound
        with rec.inside():
            result = original(*args, **kwargs)
        return handle(rec, given, result)

    return wrapper


def _p2p(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    kind = P2P[name]

    def handle(rec: _Recorder, given: dict[str, Any], result: Any) -> Any:
        pg, ident = _group(given.get("group"))
        peer = given.get("dst" if kind == "send" else "src")
        group_peer = given.get("group_dst" if kind == "send" else "group_src")
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(pg, group_peer)
        seq = rec.add(
            kind,
            name,
            peer=-1 if peer is None else peer,
            tag=given.get("tag", 0),
            **ident,
            **_tensor(given.get("tensor")),
        )
        if name in ("send", "recv"):
            rec.add_wait((seq,), False)
            return result
        return _wrap(result, (seq,))

    return _recorded(original, handle)


def _collective(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    sized = COLLECTIVES[name]

    def handle(rec: _Recorder, given: dict[str, Any], result: Any) -> Any:
        _, ident = _group(given.get("group"))
        size = _tensor(given.get(sized)) if sized else {}
        seq = rec.add("collective", name, **ident, **size)
        if given.get("async_op", False) and isinstance(result, dist.Work):
            return _Work(result, (seq,))
        rec.add_wait((seq,), given.get("timeout") is not None)
        return result

    return _recorded(original, handle)


def _batch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(p2p_op_list: list[dist.P2POp]) -> Any:
        rec = _active
        if rec is None or rec.busy() or not isinstance(p2p_op_list, list) or not p2p_op_list:
            return original(p2p_op_list)

        def sends(op: dist.P2POp) -> bool:
            return getattr(op.op, "__name__", "") == "isend"

        # A P2POp keeps the isend/irecv it was built with (patched or not); the original
        # batch_isend_irecv tells them apart by identity with the module's current ones.
        ops = []
        for op in p2p_op_list:
            fixed = object.__new__(type(op))  # P2POp.__new__ needs its arguments
            fixed.__dict__.update(vars(op))
            fixed.op = c10d.isend if sends(op) else c10d.irecv
            ops.append(fixed)
        with rec.inside():
            works = original(ops)
        batch = rec.new_batch()
        seqs = tuple(
            rec.add(
                "send" if sends(op) else "recv",
                "batch_isend_irecv",
                peer=op.peer,
                tag=op.tag,
                batch=batch,
                **_group(op.group)[1],
                **_tensor(op.tensor),
            )
            for op in p2p_op_list
        )
        real = [w for w in works if isinstance(w, dist.Work)]
        return [_Coalesced(real, seqs)] if real else works

    return wrapper


def _make_wrappers() -> None:
    if _wrappers:
        return
    for name in [*P2P, *COLLECTIVES, "batch_isend_irecv"]:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        _originals[name] = original
        if name in P2P:
            _wrappers[name] = _p2p(name, original)
        elif name in COLLECTIVES:
            _wrappers[name] = _collective(name, original)
        else:
            _wrappers[name] = _batch(original)


# Where each module held an original when it was last scanned: module id -> (the module,
# its namespace's size then, the attributes that held one). Scanning every loaded module's
# namespace takes about 0.1 s; a test records dozens of runs per process, and between them
# only newly imported modules (and namespaces that grew) need a look again.
_seen: dict[int, tuple[Any, int, tuple[str, ...]]] = {}


def _holders(module: Any, by_id: dict[int, tuple[Any, Any]]) -> tuple[int, tuple[str, ...]] | None:
    """The size of ``module``'s namespace and its attributes holding an original."""
    try:
        names = vars(module)
    except TypeError:
        return None
    found = tuple(
        attr
        for attr, value in list(names.items())
        if (hit := by_id.get(id(value))) is not None and hit[0] is value
    )
    return len(names), found


def _patch() -> list[tuple[Any, str, Any]]:
    """Put the wrappers wherever a loaded module holds an original (``torch.distributed``,
    ``distributed_c10d`` and ``from ... import`` copies); returns how to undo it.

    A module scanned before whose namespace has the same size is not scanned again: only
    the attributes it held an original in are looked at (a module that rebinds an existing
    name to an original at run time would be missed; none of torch's or conveyor's does).
    """
    by_id = {id(f): (f, _wrappers[n]) for n, f in _originals.items()}
    undo = []
    for module in list(sys.modules.values()):
        seen = _seen.get(id(module))
        if seen is not None and seen[0] is module:
            try:
                size = len(vars(module))
            except TypeError:
                continue
            attrs = seen[2] if size == seen[1] else None
        else:
            attrs = None
        if attrs is None:
            held = _holders(module, by_id)
            if held is None:
                continue
            _seen[id(module)] = (module, *held)
            attrs = held[1]
        names = vars(module)
        for attr in attrs:
            value = names.get(attr)
            hit = by_id.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(module, attr, hit[1])
                undo.append((module, attr, value))
    return undo


def _named(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _process_group(name: Any) -> Any:
    return name if isinstance(name, dist.ProcessGroup) else _resolve_process_group(name)


class _Functional(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sees the ``_c10d_functional`` ops (DTensor, funcol) and their ``wait_tensor``."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rec = rec
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor

        self.defer = (DTensor, AsyncCollectiveTensor)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if any(t is not torch.Tensor for t in types):
            if all(t is torch.Tensor or issubclass(t, self.defer) for t in types):
                # DTensor and AsyncCollectiveTensor unwrap first, with this mode still on,
                # so the collectives they issue are seen here.
                return NotImplemented
            return func(*args, **kwargs)  # e.g. FakeTensor: it runs with the mode off
        if func.namespace != "_c10d_functional" or self.rec.busy():
            return func(*args, **kwargs)
        op = func._opname
        if op == "wait_tensor":
            self.wait(args[0] if args else kwargs["tensor"])
            return func(*args, **kwargs)
        if op == "_wrap_tensor_autograd":
            return func(*args, **kwargs)
        given = _named(func, args, kwargs)
        pg = _process_group(given["group_name"])
        _, ident = _group(pg)
        with self.rec.inside():
            out = func(*args, **kwargs)
        name = f"_c10d_functional.{op}"
        if op in ("isend", "irecv"):
            peer = dist.get_global_rank(pg, given["dst" if op == "isend" else "src"])
            seqs: tuple[int, ...] = (
                self.rec.add(
                    op[1:],
                    name,
                    peer=peer,
                    tag=given.get("tag"),
                    **ident,
                    **_tensor(given["tensor"]),
                ),
            )
        elif op == "batch_p2p_ops":
            batch = self.rec.new_batch()
            seqs = tuple(
                self.rec.add(
                    kind[1:],
                    name,
                    peer=dist.get_global_rank(pg, peer),
                    tag=tag,
                    batch=batch,
                    **ident,
                    **_tensor(t),
                )
                for kind, peer, tag, t in zip(
                    given["op_list"],
                    given["peer_list"],
                    given["tag_list"],
                    given["tensors"],
                    strict=True,
                )
            )
        else:
            data = given.get("input", given.get("inputs"))
            seqs = (self.rec.add("collective", name, **ident, **_tensor(data)),)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and (ptr := _address(t)):
                self.rec.outputs[ptr] = seqs
        return out

    def wait(self, tensor: torch.Tensor) -> None:
        seqs = self.rec.outputs.pop(_address(tensor), None)
        if seqs is not None:
            self.rec.add_wait(seqs, False, "wait_tensor")


def _address(t: torch.Tensor) -> int:
    """Where a tensor's storage lives: what is waited on is often another tensor object
    (an autograd alias) over the collective's output."""
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:  # no storage (a subclass); not a collective's output
        return 0


@contextlib.contextmanager
def recording(library: str = "conveyor", functional: bool = True) -> Iterator[Trace]:
    """Record, in posting order, what this process posts until the block ends.

    ``library``: the package whose innermost frame is a record's ``where``;
    ``functional``: also record the functional collectives (a TorchDispatchMode is on
    for the block, which slows every op a little).
    """
    global _active
    if _active is not None:
        raise RuntimeError("recording() is already active in this process")
    _make_wrappers()
    rec = _Recorder(library)
    undo = _patch()
    mode = _Functional(rec) if functional else None
    _active = rec
    try:
        if mode is None:
            yield rec.trace
        else:
            with mode:
                yield rec.trace
    finally:
        _active = None
        for module, attr, value in reversed(undo):
            setattr(module, attr, value)
