"""The vocabulary passes of a step on this rank (:data:`~conveyor.schedules.vocab.VOCAB_KINDS`).

Every pipeline rank runs every pass, on its rows ``[lo, hi)`` of the vocabulary, with
collectives on the vocabulary group (a communicator of its own over the pipeline ranks):

- ``E``: the embedding of the micro-batch's token ids in this rank's rows (zero
  elsewhere), summed onto the first stage's rank (reduce); there it becomes the stage's
  input embedding, an autograd leaf.
- ``S``: the last stage's hidden states, broadcast from its rank; this rank's logits and
  their statistics, all-gathered; every rank then knows each token's loss, and the last
  stage's rank adds the micro-batch's ``(total, count)`` to the step's loss. (In a predict
  step the logits are gathered onto the last stage's rank instead: the output.)
- ``T``: the gradient of the logits held here, the weight gradient of these rows, and the
  hidden states' gradient summed onto the last stage's rank (reduce), where the last
  stage's backward starts from it.
- ``G``: the first stage's input gradient, broadcast from its rank; each rank adds it to
  the embedding rows of the tokens it holds.

The posting order on the group is the schedule's order of passes, the same on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from conveyor.errors import PipelineError
from conveyor.losses import output_field
from conveyor.partition.cuts import rows_per_rank
from conveyor.runtime.ends import add_term
from conveyor.runtime.step_loss import LossTerm, RouterLoss
from conveyor.runtime.step_state import StepState
from conveyor.runtime.transport import collective
from conveyor.schedules.core import Pass
from conveyor.vocab.config import Group, VocabLoss
from conveyor.vocab.cross_entropy import combine, local_targets, shard_grad, shard_stats
from conveyor.vocab.shards import Takes, VocabShards, with_embedding

__all__ = ["Group", "VocabLoss", "VocabRunner"]


class VocabRunner:
    """The stage ends of vocabulary parallelism (:class:`~conveyor.runtime.ends.StageEnds`):
    runs the vocabulary passes of this rank's steps (module doc) and hands the first stage
    its input embedding and the last stage's hidden states to the passes."""

    every_rank = True  # every rank embeds and scores its rows: it reads the batch
    # A forward-only step embeds (E) and scores or predicts (S); T and G are the backward.
    forward_passes = frozenset({"E", "S"})

    def __init__(
        self,
        shards: VocabShards,
        loss: VocabLoss,
        group: Group,
        device: torch.device,
        autocast: torch.dtype | None,
        router: RouterLoss | None = None,
    ) -> None:
        self.shards = shards
        self.loss = loss
        self.group = group
        self.device = device
        self.autocast = autocast
        # A transformers MoE model's own loss adds its router auxiliary term (loss_fn=None).
        self.router = router
        self.routed = router is not None
        self._aux: dict[int, torch.Tensor] = {}  # the ones the auxiliary roots start from
        self._router: dict[int, LossTerm] = {}  # each one's term, added with S's
        # How the first stage takes its embedding (:func:`~conveyor.vocab.shards.first_stage`).
        self.takes: Takes = "inputs_embeds" if shards.layers.transformers else "replace"
        self._state = StepState("train")
        self._inputs: list[Any] = []
        self._targets: list[Any] = []
        self._embedded: dict[int, torch.Tensor] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]] = {}
        self._hidden_grad: dict[int, torch.Tensor] = {}
        self._input_grad: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------ the step's data
    def begin(self, state: StepState, inputs: list[Any] | None, targets: list[Any] | None) -> None:
        """Start a step: its state and this rank's micro-batches (every rank reads them)."""
        if inputs is None:
            raise PipelineError(
                "vocab_parallel: every pipeline rank embeds its rows of the vocabulary, so "
                "every rank needs the inputs; pass the batch on every rank"
            )
        self._state = state
        self._inputs = inputs
        self._targets = targets or []
        for kept in (self._embedded, self._hidden, self._kept, self._hidden_grad,
                     self._input_grad, self._aux, self._router):  # fmt: skip
            kept.clear()

    def _ids(self, m: int) -> torch.Tensor:
        return token_ids(self._inputs[m])

    def _labels(self, m: int) -> tuple[torch.Tensor, bool]:
        """Micro-batch ``m``'s labels, and whether they are shifted already: a transformers
        model's ``shift_labels`` input, which its own loss reads as given (context
        parallelism shifts the labels so, before it cuts the sequence)."""
        if self.loss.labels_in_inputs:
            value = self._inputs[m]
            shifted = value.get("shift_labels") if isinstance(value, dict) else None
            if shifted is not None:
                return shifted, True
            labels = value.get("labels") if isinstance(value, dict) else None
            if labels is None:
                raise PipelineError(
                    "vocab_parallel with loss_fn=None reads the loss's labels from the inputs; "
                    "pass labels in the inputs dict"
                )
            return labels, False
        if not self._targets:
            raise PipelineError(
                "vocab_parallel: every pipeline rank computes the loss of its rows, so every "
                "rank needs the targets; pass them on every rank"
            )
        return self._targets[m], False

    # ------------------------------------------------------------ the first stage's end
    def first_input(self, m: int, value: Any) -> Any:
        """What the first stage runs on for micro-batch ``m``: its embedding (the E pass's
        leaf) as an input of its own (:data:`Takes`)."""
        return with_embedding(value, self._embedded_for(m), self.takes)

    def sample(self, value: Any) -> Any:
        """A capture sample as the first stage sees it (:meth:`first_input`, zeros)."""
        if self.takes == "replace" or (
            self.takes == "inputs_embeds"
            and (not isinstance(value, dict) or "input_ids" not in value)
        ):
            return value
        ids = token_ids(value)
        weight = self.shards.local(self.shards.embedding)
        # On the meta device for a meta model: export then records the model there.
        where = weight.device if weight.is_meta else ids.device
        zeros = torch.zeros(
            (*ids.shape, self.shards.layers.hidden), dtype=weight.dtype, device=where
        )
        return with_embedding(value, zeros, self.takes)

    def _embedded_for(self, m: int) -> torch.Tensor:
        try:
            return self._embedded[m]
        except KeyError:
            raise PipelineError(
                f"vocab_parallel: the first stage ran micro-batch {m} before its embedding "
                f"pass (E{m}); the schedule is inconsistent"
            ) from None

    def input_grad(self, m: int, leaves: list[torch.Tensor], grads: list[Any]) -> None:
        """The first stage's backward of micro-batch ``m`` computed its embedding's
        gradient (G broadcasts it)."""
        embedded = self._embedded.get(m)
        grad = next((g for x, g in zip(leaves, grads, strict=True) if x is embedded), None)
        if embedded is not None:
            self._input_grad[m] = grad if grad is not None else torch.zeros_like(embedded)

    # ------------------------------------------------------------ the last stage's end
    def last_output(self, m: int, out: Any, recomputing: bool = False) -> list[torch.Tensor]:
        """The last stage's hidden states of micro-batch ``m``, kept for its S pass; its
        backward starts from their gradient (the T pass's)."""
        hidden = self._hidden_of(out)
        if not recomputing:
            self._hidden[m] = hidden
        state = self._state
        router = self.router
        # The hidden states hold no share of the auxiliary term: none counted in it.
        term = router.term(out, state.aux_weight) if router and state.mode != "predict" else None
        if term is None:
            return [hidden]
        if not recomputing:  # added to the step's loss with the micro-batch's S
            self._router[m] = term._replace(value=term.value.detach())
        root = term.root(state.scale)
        self._aux[m] = torch.ones_like(root)
        return [hidden, root]

    def output_grad(self, m: int) -> list[torch.Tensor] | None:
        """The gradient of the last stage's output of micro-batch ``m`` (from T), and of
        its router auxiliary term (one)."""
        aux = self._aux.pop(m, None)
        hidden = self._hidden_grad.pop(m)
        return [hidden] if aux is None else [hidden, aux]

    def _hidden_of(self, out: Any) -> torch.Tensor:
        """The last stage's output as the hidden states: a tensor, or the ``logits``
        field of a model output (the output layer's stand-in filled it with them)."""
        hidden = out if isinstance(out, torch.Tensor) else output_field(out, "logits")
        if not isinstance(hidden, torch.Tensor) or hidden.shape[-1] != self.shards.layers.hidden:
            raise PipelineError(
                "vocab_parallel: the last stage's output is not the hidden states the output "
                f"layer {self.shards.layers.output} takes; return its result from the model"
            )
        return hidden

    # ------------------------------------------------------------ the passes
    def run_pass(self, step: Pass) -> None:
        """Run pass ``step`` (of a kind of :data:`~conveyor.schedules.vocab.VOCAB_KINDS`)
        on this rank's rows."""
        run = {"E": self._embed, "S": self._output_forward, "T": self._output_backward,
               "G": self._embedding_grad}  # fmt: skip
        run[step.kind](step.microbatch)

    def _collective(self, what: str, m: int, start: Callable[[dist.ProcessGroup], Any]) -> None:
        g = self.group
        if g.group is None:
            return
        pg = g.group()
        collective(
            lambda: start(pg),
            g.timeout,
            f"rank {g.me}: the vocabulary {what} of micro-batch {m}",
            "another pipeline rank",
        )

    def _embed(self, m: int) -> None:
        ids = self._ids(m)
        shards, g = self.shards, self.group
        weight = shards.local(shards.embedding)
        index = ids - shards.lo
        held = (index >= 0) & (index < weight.shape[0])
        if weight.shape[0]:
            out = F.embedding(index.clamp(0, weight.shape[0] - 1), weight.detach())
            out = out * held[..., None].to(out.dtype)
        else:
            out = weight.new_zeros((*ids.shape, self.shards.layers.hidden))
        self._collective(
            "embedding sum (reduce)", m,
            lambda pg: dist.reduce(out, g.first, dist.ReduceOp.SUM, group=pg, async_op=True),
        )  # fmt: skip
        if g.group is None or g.me == g.first:
            self._embedded[m] = out.requires_grad_(self._state.train)

    def _output_forward(self, m: int) -> None:
        ids = self._ids(m)
        shards, g, state = self.shards, self.group, self._state
        hidden = self._hidden.get(m)
        dtype = self._transport_dtype()
        if hidden is not None:
            flat = hidden.detach().to(dtype).reshape(-1, self.shards.layers.hidden)
        else:
            tokens = ids.numel()
            flat = torch.empty((tokens, self.shards.layers.hidden), dtype=dtype, device=self.device)
        self._collective(
            "hidden-state broadcast", m,
            lambda pg: dist.broadcast(flat, g.last, group=pg, async_op=True),
        )  # fmt: skip
        weight = shards.local(shards.output).detach()
        with self._autocast():
            logits = flat @ weight.t() if weight.shape[0] else flat.new_zeros((flat.shape[0], 0))
        if state.mode == "predict":
            self._gather_logits(m, logits, ids)
            return
        loss = self.loss
        labels, shifted = self._labels(m)
        labels = labels.to(self.device)
        shift = loss.shift and not shifted
        targets = local_targets(labels, loss.ignore_index, shift, shards.lo, shards.hi)
        stats = shard_stats(logits, targets, loss.label_smoothing)
        ranks = 1 if g.group is None else g.group().size()
        gathered = torch.empty((ranks, *stats.shape), dtype=stats.dtype, device=stats.device)
        if g.group is None:
            gathered[0] = stats
        self._collective(
            "statistics all-gather", m,
            lambda pg: dist.all_gather(list(gathered.unbind(0)), stats, group=pg, async_op=True),
        )  # fmt: skip
        rows = shards.layers.rows
        combined = combine(gathered, rows, loss.label_smoothing)
        weight_tok = targets.valid.to(torch.float32)
        if g.group is None or g.me == g.last:
            total = (combined.loss * weight_tok).sum()
            counter = loss.counter if not shifted else None
            items = counter(labels) if counter is not None else targets.valid.sum()
            term = LossTerm(total, 1, items, True)
            router = self._router.pop(m, None)
            add_term(state, term if router is None else term.plus(router), m)
        if state.train:
            self._kept[m] = (flat, logits, targets, combined.lse)

    def _output_backward(self, m: int) -> None:
        flat, logits, targets, lse = self._kept.pop(m)
        shards, g, state = self.shards, self.group, self._state
        loss = self.loss
        weight_tok = targets.valid.to(torch.float32) * state.scale
        rows = shards.layers.rows
        grad = shard_grad(logits, lse, targets, weight_tok, rows, loss.label_smoothing)
        weight = shards.local(shards.output).detach()
        with self._autocast():
            grad_in = (
                (grad.to(flat.dtype) @ weight.to(flat.dtype))
                if weight.shape[0]
                else (torch.zeros_like(flat))
            )
            grad_w = grad.t().to(flat.dtype) @ flat  # [0, hidden] on a rank of no rows
        grad_in = grad_in.to(flat.dtype)
        shards.add_grad(shards.output, grad_w)
        self._collective(
            "hidden-state gradient sum (reduce)", m,
            lambda pg: dist.reduce(grad_in, g.last, dist.ReduceOp.SUM, group=pg, async_op=True),
        )  # fmt: skip
        if g.group is None or g.me == g.last:
            hidden = self._hidden.pop(m)
            self._hidden_grad[m] = grad_in.reshape(hidden.shape).to(hidden.dtype)

    def _embedding_grad(self, m: int) -> None:
        ids = self._ids(m)
        shards, g = self.shards, self.group
        weight = shards.local(shards.embedding)
        if g.group is None or g.me == g.first:
            grad = self._input_grad.pop(m).detach().to(weight.dtype).contiguous()
            self._embedded.pop(m, None)
        else:
            grad = torch.empty(
                (*ids.shape, self.shards.layers.hidden), dtype=weight.dtype, device=self.device
            )
        self._collective(
            "embedding gradient broadcast", m,
            lambda pg: dist.broadcast(grad, g.first, group=pg, async_op=True),
        )  # fmt: skip
        index = (ids - shards.lo).reshape(-1)
        held = (index >= 0) & (index < weight.shape[0])
        padding = shards.embedding.padding_idx
        if padding is not None:
            held &= ids.reshape(-1).ne(padding)
        if weight.shape[0]:
            rows = grad.reshape(-1, grad.shape[-1]) * held[:, None].to(grad.dtype)
            shards.add_rows(shards.embedding, index.clamp(0, weight.shape[0] - 1), rows)
        else:  # no rows here: the gradient of none, so that every parameter has one
            shards.add_grad(shards.embedding, torch.zeros_like(weight))

    def _gather_logits(self, m: int, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """A predict step's output: every rank's logits, concatenated on the last stage's."""
        g, rows = self.group, self.shards.layers.rows
        if g.group is None:
            whole = logits
        else:
            ranks = g.group().size()
            size = rows_per_rank(rows, ranks)
            padded = logits.new_zeros((logits.shape[0], size))
            padded[:, : logits.shape[1]] = logits
            parts = logits.new_empty((ranks, logits.shape[0], size))
            self._collective(
                "logits all-gather", m,
                lambda pg: dist.all_gather(list(parts.unbind(0)), padded, group=pg, async_op=True),
            )  # fmt: skip
            whole = parts.permute(1, 0, 2).reshape(logits.shape[0], ranks * size)[:, :rows]
        if g.group is None or g.me == g.last:
            self._state.outputs[m] = whole.reshape(*ids.shape, rows)

    def _transport_dtype(self) -> torch.dtype:
        """The dtype the hidden states travel in, the same on every rank: float32 under
        autocast (it casts them for the matmul as the unsplit model's output layer
        would), else the output weight's."""
        if self.autocast is not None:
            return torch.float32
        return self.shards.output.weight.dtype

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)


def token_ids(value: Any) -> torch.Tensor:
    """The token ids of a micro-batch: the tensor, the ``input_ids`` entry, or the first
    integer tensor of a tuple or dict."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        if "input_ids" in value:
            return value["input_ids"]  # type: ignore[no-any-return]
        value = tuple(value.values())
    found = [x for x in value if isinstance(x, torch.Tensor) and not x.is_floating_point()]
    if not found:
        raise PipelineError(
            "vocab_parallel: the inputs hold no integer tensor of token ids; pass the "
            "ids as the first input (or as input_ids)"
        )
    return found[0]
