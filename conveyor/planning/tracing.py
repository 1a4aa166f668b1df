"""One traced step of a model on the meta device: a forward with its loss and two
backwards, every aten operation filed under the part of the model that ran it.

The parts are what comes before the decoder layers (``pre``: the embeddings), each traced
layer, and what comes after (``post``: final norm, head and loss). Which one runs in F is
asked of torch's :class:`~torch.utils.module_tracker.ModuleTracker` (:class:`Parts`); in a
backward, it is the part whose forward made the autograd node running (:class:`Nodes`
marks each node as F makes it), which holds for any module, also one that returns
outputs nothing reads (BLOOM's attention returns its probabilities).

- F: the forward and loss.
- B: the gradients with respect to every layer's input only (``autograd.grad`` on those
  tensors; autograd then skips every weight gradient).
- W: the whole backward less B, operation by operation: exactly the weight-gradient work.

A transformers model runs its attention through an implementation registered for the
trace only (:func:`counting_attention`): transformers' own SDPA function, without a mask
built for it. Building one would look for sequences packed into one row of position ids,
a branch on tensor values that the meta device cannot take; the traced row is one
sequence, and the flash kernel counted needs no mask.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.module_tracker import ModuleTracker

from conveyor.errors import ConfigError
from conveyor.partition.experts import is_experts_collection
from conveyor.planning.model_count import Record
from conveyor.planning.recording import (
    FlashAttention,
    FusedDropout,
    MathAttention,
    Recorder,
    SavedBytes,
    Scores,
    nbytes,
    tensors,
)

ATTENTION_NAME = "conveyor-count"
"""The attention implementation a transformers model is counted with (see the docstring)."""


@dataclass
class Run:
    """What one traced forward and its two backwards recorded, by part index (``pre`` 0,
    the traced layers 1 to n, ``post`` n + 1).

    Attributes:
        forward: The ops of F.
        backward: The ops of B.
        whole: The ops of B and W together.
        saved: Bytes autograd saved in F (a hand-written attention's log-sum-exp too).
        wide: Of ``saved``, the tensors as wide as the hidden states.
        workspace: The most bytes of new tensors alive at once in F beyond what F
            saved, or in B.
        routed: Bytes of hidden states sent to experts (once per expert chosen).
        reads: The ids of the parameters each part read in F.
        hidden: Bytes of the first layer's input (one sequence's hidden states).
    """

    forward: dict[int, list[Record]]
    backward: dict[int, list[Record]]
    whole: dict[int, list[Record]]
    saved: collections.Counter[int]
    wide: collections.Counter[int]
    workspace: dict[int, float]
    routed: collections.Counter[int]
    reads: dict[int, set[int]]
    hidden: float


class Parts:
    """The index of the part running now. In F: a traced layer while it is among the
    modules :class:`~torch.utils.module_tracker.ModuleTracker` reports running; outside
    them the part after the last layer that ran (``pre`` before the first). In a backward:
    the part that made the autograd node running (:class:`Nodes`), ``post`` before any."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]) -> None:
        names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        root = type(model).__name__  # how ModuleTracker names the module it meets first
        self.index = {f"{root}.{names[id(layer)]}": i for i, layer in enumerate(layers)}
        self.after = len(layers) + 1
        self.tracker = ModuleTracker()
        self.backward = False
        self.last: int | None = None
        self.node: int | None = None  # the part of the backward's running node

    def begin(self, backward: bool) -> None:
        """A new pass begins: F, or a backward."""
        self.backward, self.last, self.node = backward, None, None

    def __call__(self) -> int:
        if self.backward:
            return self.after if self.node is None else self.node
        for name in self.tracker.parents:
            i = self.index.get(name)
            if i is not None:
                self.last = i
                return i + 1
        return 0 if self.last is None else self.last + 2


class Nodes(TorchFunctionMode):
    """Marks every autograd node the forward makes with the part running when it is made
    (walking back from each result to the nodes not yet marked); a hook on the node sets
    that part while a backward runs it."""

    def __init__(self, parts: Parts) -> None:
        super().__init__()
        self.parts = parts
        self.marked: dict[int, Any] = {}  # kept alive, so that no other node takes an id

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        part = self.parts()
        stack: list[Any] = [t.grad_fn for t in tensors(out) if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or id(node) in self.marked:
                continue
            self.marked[id(node)] = node
            node.register_prehook(functools.partial(self._enter, part))
            stack.extend(n for n, _ in node.next_functions)
        return out

    def _enter(self, part: int, grads: Any) -> None:
        self.parts.node = part


def trace(
    model: nn.Module,
    layers: list[nn.Module],
    seq: int,
    hidden: int = 0,
    heads: int = 0,
    fused: bool = True,
) -> Run:
    """Run ``model`` on one sequence of ``seq`` tokens and record it (see the docstring).

    Args:
        model: A causal language model on the meta device, taking ``input_ids`` and
            ``labels``.
        layers: Its decoder layers to trace, each called once per forward.
        seq: Tokens in the sequence.
        hidden: Its hidden size (0: unknown).
        heads: Its attention heads (0: unknown; attention written by hand is then counted
            as written).
        fused: Count attention as the flash kernel (SDPA's and attention written by hand);
            else as it is written, SDPA as its math form.
    """
    params = {id(p): p for p in model.parameters()}
    parts = Parts(model, layers)
    scores = Scores(seq, heads if fused else 0)
    flash = FlashAttention if fused else MathAttention
    recorder = Recorder(params, parts, scores, lambda: parts.backward)
    saved = SavedBytes(set(params), parts, hidden, scores)
    inputs: list[Tensor] = []
    routed: collections.Counter[int] = collections.Counter()

    def keep_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        inputs.append(next(tensors(args)))

    def route(module: nn.Module, args: tuple[Any, ...]) -> None:
        hidden, chosen = args[0], args[1]  # the experts interface: (states, top-k index, ...)
        routed[parts()] += int(nbytes(hidden) * chosen.shape[-1])

    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with contextlib.ExitStack() as stack:
        for layer in layers:
            stack.callback(layer.register_forward_pre_hook(keep_input).remove)
        for module in model.modules():
            if is_experts_collection(module):
                stack.callback(module.register_forward_pre_hook(route).remove)
        stack.enter_context(parts.tracker)
        parts.begin(backward=False)
        with (
            Nodes(parts),
            flash(),
            FusedDropout(),
            recorder,
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t),
        ):
            loss = _loss(model, ids)
        forward, in_forward = recorder.take()
        reads = {k: set(v) for k, v in recorder.reads.items()}
        parts.begin(backward=True)
        with flash(), recorder:
            grads = torch.autograd.grad(loss, inputs, retain_graph=True)
        backward, in_backward = recorder.take()
        del grads
        parts.begin(backward=True)
        wanted = [p for p in model.parameters() if p.requires_grad]
        with flash(), recorder:
            torch.autograd.grad(loss, [*inputs, *wanted], allow_unused=True)
        whole, _ = recorder.take()
    kept = saved.bytes + recorder.lse
    workspace = {
        i: max(in_forward[i] - kept[i], in_backward[i], 0.0)
        for i in set(in_forward) | set(in_backward)
    }
    return Run(
        forward, backward, whole, kept, saved.wide, workspace, routed, reads, nbytes(inputs[0])
    )


@contextlib.contextmanager
def counting_attention() -> Iterator[None]:
    """:data:`ATTENTION_NAME` among transformers' attention implementations while the
    block runs (none registered when transformers is not installed)."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        yield
        return
    mine = ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS  # not already there (a nested count)
    if mine:
        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = sdpa_attention_forward
    try:
        yield
    finally:
        if mine:
            del ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]  # type: ignore[no-untyped-call]


def _loss(model: nn.Module, ids: Tensor) -> Tensor:
    try:
        out = model(input_ids=ids, labels=ids)
    except TypeError as error:
        raise ConfigError(
            f"{type(model).__name__} does not take input_ids and labels ({error}); "
            "count a transformers causal language model"
        ) from None
    loss = (
        out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else getattr(out, "loss", None)
    )
    if not isinstance(loss, Tensor):
        raise ConfigError(
            f"{type(model).__name__} returned no loss for labels; count a causal language model"
        )
    return loss
