"""Compiled stages (``Pipeline(compile=...)``): exact on every schedule, the split backward
included; compiled code really ran; few recompiles.

Most tests compile with ``backend="aot_eager"``: dynamo and AOTAutograd exactly as with
inductor (the graphs, the custom linear ops, the compiled backward nodes B and W meet),
without inductor's C++ builds, which take tens of seconds on two cores. One test runs
inductor itself.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.errors import ConfigError
from conveyor.runtime.compiled import CompileStats, compile_stages, frames_compiled
from conveyor.runtime.deferred_linear import LinearWeightStore
from conveyor.runtime.split_backward import backward_input
from conveyor.schedules import SCHEDULE_NAMES, default_chunks
from tests.support import distributed
from tests.support.helpers import assert_close, grads_of

EAGER_GRAPHS = {"backend": "aot_eager"}


class Block(nn.Module):
    """Pre-norm attention (``scaled_dot_product_attention``) and MLP, each with a skip."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def model(blocks: int = 4) -> nn.Sequential:
    """A layer list: an input projection, ``blocks`` blocks and a head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), *[Block() for _ in range(blocks)], nn.Linear(16, 4))


def batch(length: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    return torch.randn(rows, length, 8, generator=g), torch.randn(rows, length, 4, generator=g)


def unsplit_grads(net: nn.Module, lengths: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """The eager unsplit model's gradients of each step (SGD between steps)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = []
    for t in lengths:
        opt.zero_grad()
        x, y = batch(t)
        F.mse_loss(net(x), y).backward()
        out.append(grads_of(net.named_parameters()))
        opt.step()
    return out


def pipe_grads(pipe: conveyor.Pipeline, lengths: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """The same steps through ``pipe`` (this rank's parameters)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out = []
    for t in lengths:
        opt.zero_grad()
        x, y = batch(t)
        pipe.train_step(x, y)
        out.append(grads_of(pipe.named_parameters()))
        opt.step()
    return out


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="compile must be True, False or a dict"):
        conveyor.Pipeline(model(1), loss_fn=F.mse_loss, microbatches=2, compile="yes")
    with pytest.raises(ConfigError, match=r"which torch\.compile does not take"):
        conveyor.Pipeline(model(1), loss_fn=F.mse_loss, microbatches=2, compile={"speed": 2})


def test_recompiles_leave_out_each_units_first_graph() -> None:
    stats = CompileStats(graphs={0: {"Block": 3, "Linear": 1}, 1: {"Block": 1}})
    assert (stats.recompiles(0), stats.recompiles(1), stats.recompiles(2)) == (2, 0, 0)


@pytest.mark.slow
def test_b_leaves_linear_weight_gemms_to_w() -> None:
    """B of a compiled block computes no linear weight gradient (the block's layer norms
    get theirs in B, from the same compiled call); W adds the rest: together the eager
    gradients."""
    eager = Block()
    block = copy.deepcopy(eager)
    compile_stages({0: block}, EAGER_GRAPHS)
    x, g = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16)
    params = list(block.parameters())
    store = LinearWeightStore(params, opaque=True)
    with store.capture((0, 0)):
        out = block(x)
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"
    got = backward_input(
        [out], [g], [x], lambda keep: store.collecting((0, 0) if keep else None)
    )
    assert all(m.weight.grad is None for m in (block.qkv, block.proj, block.fc1, block.fc2))
    assert block.ln1.weight.grad is not None
    assert len(store.kept((0, 0))) == 8  # (X, dY) of the four linears
    store.flush([(0, 0)])
    xe = x.detach().requires_grad_()
    eager(xe).backward(g)
    assert got[0] is not None and xe.grad is not None
    assert_close({"input": got[0]}, {"input": xe.grad}, "input gradient")
    assert_close(grads_of(block.named_parameters()), grads_of(eager.named_parameters()), "block")


SPLIT = [s for s in SCHEDULE_NAMES if s.startswith(("zb", "v-")) or s in ("zbv", "dualpipev")]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", *SPLIT])
def test_every_schedule_exact_over_two_lengths(schedule: str) -> None:
    """Two steps whose sequence lengths differ: within 1e-4 of the eager unsplit model."""
    net = model()
    want = unsplit_grads(copy.deepcopy(net), (5, 7))
    frames = frames_compiled()
    pipe = conveyor.Pipeline(
        net,
        loss_fn=F.mse_loss,
        microbatches=4,
        schedule=schedule,
        chunks=default_chunks(schedule),
        context=conveyor.init(pp=2),
        compile=EAGER_GRAPHS,
    )
    got = pipe_grads(pipe, (5, 7))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, f"{schedule} step {step}")
    assert frames_compiled() > frames  # the compiled code ran
    stats = pipe.compile_stats
    assert stats is not None and sum(map(len, stats.graphs.values())) >= 2  # Linear, Block
    assert "compiled:" in repr(pipe)


@pytest.mark.slow
def test_at_most_two_graphs_per_unit_over_four_lengths() -> None:
    """A new length compiles once more, dynamic; the next lengths reuse it."""
    from torch._dynamo.utils import counters

    before = int(counters["stats"]["unique_graphs"])
    pipe = conveyor.Pipeline(
        nn.Sequential(*[Block() for _ in range(4)]),
        loss_fn=F.mse_loss,
        microbatches=2,
        schedule="zb-h1",
        context=conveyor.init(pp=2),
        compile=EAGER_GRAPHS,
    )
    from conveyor.observe.progress import Progress

    progress = Progress(pipe, total=4, every=0)
    lines = []
    for t in (5, 7, 9, 12):
        x = torch.randn(2, t, 16)
        lines.append(progress.step(pipe.train_step(x, torch.randn(2, t, 16)), 2))
    progress.close()
    # the progress line says which steps compiled: the first two lengths, not the others
    assert ["compiling" in line for line in lines] == [True, True, False, False], lines
    stats = pipe.compile_stats
    assert stats is not None
    for s in (0, 1):
        graphs = sum(stats.graphs.get(s, {}).values())
        assert stats.recompiles(s) <= 2 and graphs <= 2, (s, stats.graphs)
    assert int(counters["stats"]["unique_graphs"]) - before <= 2  # one Block code, 2 graphs
    assert "recompile(s)" in repr(pipe) and " s" in repr(pipe)


class Timed(nn.Module):
    """A block that adds a learned embedding of the positions: that Linear's input is made
    inside the block and needs no gradient (a diffusion model's timestep embedding)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed, self.fc = nn.Linear(4, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)
        phases = torch.stack([t.sin(), t.cos(), (t / 3).sin(), (t / 3).cos()], dim=-1)
        return torch.tanh(self.fc(x)) + self.embed(phases)


def test_a_linear_whose_input_needs_no_gradient_gets_its_gradient_under_a_split() -> None:
    """zb-h1, compiled: the embedding's weight gradient is the eager one (it is 0 when such
    a Linear is taken into the opaque op: nothing asks for its input's gradient)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Timed(), Timed(), nn.Linear(16, 4))
    want = unsplit_grads(copy.deepcopy(net), (5,))
    pipe = conveyor.Pipeline(
        net, loss_fn=F.mse_loss, microbatches=2, schedule="zb-h1",
        context=conveyor.init(pp=2), compile=EAGER_GRAPHS,
    )  # fmt: skip
    got = pipe_grads(pipe, (5,))
    assert float(want[0]["1.embed.weight"].abs().max()) > 1e-3
    assert sorted(set(want[0]) - set(got[0])) == []  # every parameter got a gradient
    assert_close(got[0], want[0], "zb-h1 compiled")


@pytest.mark.slow
@pytest.mark.parametrize("option", ["recompute", "autocast"])
def test_recompute_and_autocast(option: str) -> None:
    """Recompute: the unsplit model's gradients; autocast: the eager pipeline's."""
    extra: dict[str, Any] = (
        {"recompute": True} if option == "recompute" else {"autocast": torch.bfloat16}
    )
    net = model(2)
    if option == "recompute":
        want = unsplit_grads(copy.deepcopy(net), (5, 7))
    else:
        eager = conveyor.Pipeline(
            copy.deepcopy(net),
            loss_fn=F.mse_loss,
            microbatches=4,
            schedule="zb-h1",
            context=conveyor.init(pp=2),
            **extra,
        )
        want = pipe_grads(eager, (5, 7))
    pipe = conveyor.Pipeline(
        net,
        loss_fn=F.mse_loss,
        microbatches=4,
        schedule="zb-h1",
        context=conveyor.init(pp=2),
        compile=EAGER_GRAPHS,
        **extra,
    )
    # under bf16, what rounds is each block's output, forward and backward
    half: dict[str, Any] = {"reduction": 4, "dtype": torch.bfloat16}
    if option == "recompute":
        half = {}
    for step, (g, w) in enumerate(zip(pipe_grads(pipe, (5, 7)), want, strict=True)):
        assert_close(g, w, f"{option} step {step}", **half)


@pytest.mark.slow
def test_inductor_zero_bubble_exact() -> None:
    """Inductor itself (C++ on CPU), the custom linear ops inside its code, zb-h1."""
    net = nn.Sequential(Block(), Block())
    torch.manual_seed(0)
    want_net = copy.deepcopy(net)
    pipe = conveyor.Pipeline(
        net,
        loss_fn=F.mse_loss,
        microbatches=2,
        schedule="zb-h1",
        context=conveyor.init(pp=2),
        compile={"dynamic": True},  # one graph for both lengths
    )
    for t in (5, 7):
        x, y = torch.randn(2, t, 16), torch.randn(2, t, 16)
        for p in [*want_net.parameters(), *net.parameters()]:
            p.grad = None
        F.mse_loss(want_net(x), y).backward()
        pipe.train_step(x, y)
        assert_close(
            grads_of(net.named_parameters()),
            grads_of(want_net.named_parameters()),
            f"inductor length {t}",
        )
    assert frames_compiled() > 0


def _rank_run(rank: int, world: int, schedule: str, dp: int) -> tuple[list[Any], int, int]:
    ctx = conveyor.init(pp=world // dp, dp=dp)
    pipe = conveyor.Pipeline(
        model(),
        loss_fn=F.mse_loss,
        microbatches=4 // dp,
        schedule=schedule,
        chunks=default_chunks(schedule),
        context=ctx,
        compile=EAGER_GRAPHS,
        fsdp=dp > 1,
    )
    grads = []
    for t in (5, 7):  # each replica its rows; FSDP's gradient shards gathered whole
        x, y = batch(t)
        pipe.train_step(x[ctx.dp_rank :: dp], y[ctx.dp_rank :: dp])
        got = {}
        for name, p in pipe.named_parameters():
            grad = p.grad
            assert grad is not None
            got[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
            p.grad = None
        grads.append(got)
    stats = pipe.compile_stats
    assert stats is not None
    per_kind = [n for s in pipe.held_stages for n in stats.graphs.get(s, {}).values()]
    return grads, frames_compiled(), max(per_kind)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "schedule", "dp"), [(2, "dualpipev", 1), (4, "zb-h1", 2)])
def test_processes_exact_and_compiled_on_every_rank(world: int, schedule: str, dp: int) -> None:
    """2 processes, and 4 as pp 2 x dp 2 with FSDP2 (compiled inside its unit): every rank
    ran compiled code; together the unsplit model's gradients of each step (no update
    between the steps)."""
    net = model()
    want = [unsplit_grads(copy.deepcopy(net), (t,))[0] for t in (5, 7)]
    results = distributed.run(_rank_run, world, world, schedule, dp)
    for step in range(2):
        got: dict[str, torch.Tensor] = {}
        for grads, _, _ in results:
            got.update(grads[step])
        assert_close(got, want[step], f"{schedule} x{world} step {step}")
    assert all(frames > 0 for _, frames, _ in results), [f for _, f, _ in results]
    # graphs per unit kind: the first lengths' two; under FSDP2 one more on the last
    # stage (a guard on the gathered parameters fails once after the dynamic graph)
    assert all(most <= (2 if dp == 1 else 3) for _, _, most in results), [r[1:] for r in results]


def test_tensor_parallel_needs_static_shapes() -> None:
    """Refused where the plan is checked, before any process waits on another, unless
    shapes are static: a context of a pp=1 x tp=2 world (no process group behind it) gets
    the error at construction."""
    ctx = conveyor.Context(
        rank=0, world_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1,
        device=torch.device("cpu"), backend="gloo", distributed=True, timeout=5.0, tp_size=2,
    )  # fmt: skip

    def build(tp_plan: dict[str, Any], option: Any) -> conveyor.Pipeline:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        return conveyor.Pipeline(
            model, loss_fn=F.mse_loss, microbatches=2, tp_plan=tp_plan, compile=option,
            context=ctx,
        )  # fmt: skip

    for option in (True, {"dynamic": True}):
        with pytest.raises(ConfigError, match="compile with tp_plan needs static shapes"):
            build({"*.fc1": object()}, option)
    # Static shapes pass the check; building then needs the process groups this has not.
    with pytest.raises(Exception) as got:
        build({}, {"dynamic": False})
    assert "static shapes" not in str(got.value), got.value


@pytest.mark.slow
def test_graph_captured_stages_compile_whole_and_verify_has_a_compiled_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model split as a graph (skips across every cut) compiles each stage whole, exact
    under zbv; ``conveyor.verify --compile`` reports its compiled pass."""
    from conveyor import verify

    torch.manual_seed(0)
    net = verify.SkipNet(depth=4, width=8, inputs=8, outputs=4)
    reference = copy.deepcopy(net)
    pipe = conveyor.Pipeline(
        net,
        loss_fn=F.mse_loss,
        microbatches=2,
        schedule="zbv",
        chunks=2,
        context=conveyor.init(pp=2),
        compile=EAGER_GRAPHS,
    )
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    pipe.train_step(x, y)
    F.mse_loss(reference(x), y).backward()
    assert_close(
        grads_of(net.named_parameters()),
        grads_of(reference.named_parameters()),
        "zbv",
    )
    stats = pipe.compile_stats
    assert stats is not None and all(u == ["(whole stage)"] for u in stats.units.values())
    assert verify.main(["--schedules", "zb-h1", "--compile", "aot_eager"]) == 0
    assert "zb-h1 compiled" in capsys.readouterr().out


@pytest.mark.slow
def test_execution_sequence_compiles_per_step() -> None:
    """An execution sequence (convolutions, batch norm) compiles each step module; under
    zb-h1 its gradients are the eager pipeline's (batch norm sees the same micro-batches)."""
    from tests.support.zoo import Net, net_sequence

    x, y = torch.randn(4, 1, 6, 6), torch.randn(4, 3)
    runs = []
    for option in (False, EAGER_GRAPHS):
        net = Net()
        pipe = conveyor.Pipeline(
            net_sequence(net),
            loss_fn=F.mse_loss,
            microbatches=2,
            schedule="zb-h1",
            context=conveyor.init(pp=2),
            compile=option,
        )
        pipe.train_step(x, y)
        runs.append((grads_of(net.named_parameters()), pipe.compile_stats))
    (eager, _), (compiled, stats) = runs
    assert_close(compiled, eager, "execution sequence")
    assert stats is not None
    units = [u for s in sorted(stats.units) for u in stats.units[s]]
    assert units == ["conv1", "bn1", "layer1.0", "layer2", "fc"]  # steps with parameters
