"""Edges a new user hits, each answered where the mistake is made in one sentence that
says what to do: an error inside a stage's work names the stage, its modules, the
micro-batch and the work; a list batch; a bad time-out; a balance for another process
count; construction errors on every rank of a pp x tp mesh alike; the launcher's
rendezvous edges; the README's Use snippet and what it says about threads."""

from __future__ import annotations

import math
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import conveyor
import conveyor.cli.launch
import conveyor.context
from conveyor.cli.command import main as cli_main
from tests.docs.test_readme_snippets import readme_snippet
from tests.support import distributed
from tests.support.helpers import reset_context
from tests.support.models import batch, mlp

ROOT = Path(__file__).resolve().parents[1]


def _digits_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _digits(n: int, side: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


class _FailOnCall(nn.Module):
    """Identity, except that its ``at``-th call raises ValueError."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise ValueError(f"call {self.calls} fails")
        return x


class _NoGradient(torch.autograd.Function):
    """Identity whose backward raises (on a weight: only W runs it, B does not)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("no gradient for this weight")


class _WeightWithoutGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _NoGradient.apply(self.weight)


class _SizeBranch(nn.Module):
    """A branch on a size: fx cannot trace it, so it is captured on the first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.shape[0] > 1:
            h = h + extra
        return self.b(h)


def _one_process(model: nn.Module, **kw: Any) -> conveyor.Pipeline:
    kw.setdefault("loss_fn", nn.functional.mse_loss)
    kw.setdefault("microbatches", 2)
    return conveyor.Pipeline(model, context=conveyor.init(pp=2), **kw)


def _raised(pipe: conveyor.Pipeline, x: Any, y: Any) -> conveyor.PipelineError:
    with pytest.raises(conveyor.PipelineError) as info:
        pipe.train_step(x, y)
    assert "\n" not in str(info.value)
    return info.value


# --- 1. an error inside a stage's work names the stage, its modules, micro-batch, work ----


def test_a_wrong_input_on_a_later_step_names_stage_modules_and_microbatch() -> None:
    pipe = _one_process(_digits_model(), loss_fn=nn.functional.cross_entropy, balance=[2, 2])
    pipe.train_step(*_digits(8))
    error = _raised(pipe, *_digits(8, side=7))
    assert str(error) == (
        "the forward of stage 0 (modules 0-1) on micro-batch 0 raised RuntimeError: mat1 and "
        "mat2 shapes cannot be multiplied (4x49 and 64x32); its traceback, above this one, "
        "shows the failing line"
    )
    assert "stage 0 on rank 0: 0-1;" in str(pipe)  # the modules as print(pipe) names them
    assert isinstance(error.__cause__, RuntimeError)  # chained, with its own traceback


def test_a_failing_loss_fn_is_named_with_the_last_stage() -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise KeyError("labels")

    error = _raised(_one_process(mlp(), loss_fn=loss_fn), *batch(4))
    assert re.match(r"the forward \(with the loss\) of stage 1 \(modules \d+-12\) on "
                    r"micro-batch 0 raised KeyError: 'labels';", str(error)), str(error)


def test_conveyors_own_errors_are_not_wrapped_again() -> None:
    pipe = _one_process(mlp(), loss_fn=lambda out, y: (out - y) ** 2)
    assert str(_raised(pipe, *batch(4))).startswith("loss_fn must return a scalar tensor")


@pytest.mark.parametrize(
    ("schedule", "work"),
    [("1f1b", "backward"), ("zb-h1", "weight-gradient backward \\(W\\)")],
)
def test_a_failing_backward_or_weight_gradient_is_named(schedule: str, work: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), _WeightWithoutGradient())
    pipe = _one_process(model, schedule=schedule, balance=[2, 1])
    error = _raised(pipe, torch.randn(4, 8), torch.randn(4, 4))
    pattern = rf"the {work} of stage 1 \(modules 2\) on micro-batch(es)? [\d, ]+ raised ValueError"
    assert re.match(pattern, str(error)), str(error)
    assert isinstance(error.__cause__, ValueError)


def test_a_failing_recompute_is_named_as_one() -> None:
    # gpipe runs both forwards of stage 0 first; the third call is a recompute at B.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _FailOnCall(3), nn.Tanh(), nn.Linear(8, 4))
    pipe = _one_process(model, schedule="gpipe", balance=[2, 2], recompute=[0])
    error = _raised(pipe, *batch(4))
    assert re.match(
        r"the recomputed forward \(at its backward\) of stage 0 \(modules 0-1\) on "
        r"micro-batch \d raised ValueError: call 3 fails;",
        str(error),
    ), str(error)


# --- 2. a list batch -----------------------------------------------------------------------


def test_a_list_batch_says_tensor_tuple_or_dict() -> None:
    pipe = _one_process(_digits_model(), loss_fn=nn.functional.cross_entropy, balance=[2, 2])
    x, y = _digits(8)
    for args, what in (([[x], y]), "inputs"), (([x, [y]]), "targets"):
        with pytest.raises(conveyor.ConfigError, match=rf"^{what} is a list; pass a tensor, a "
                           rf"tuple or a dict of tensors .* e\.g\. tuple\({what}\)$"):
            pipe.train_step(*args)
    with pytest.raises(conveyor.ConfigError, match=r"^inputs is a list"):
        pipe.predict([x])
    assert pipe.predict((x,)).shape == (8, 10)  # the tuple it asks for works


# --- 3. a bad time-out ---------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [-5, 0, math.nan, math.inf, "30", True])
def test_a_bad_timeout_is_refused(timeout: Any) -> None:
    with pytest.raises(conveyor.ConfigError, match=r"^timeout must be a finite number of "
                       r"seconds > 0, got timeout=.*; pass e\.g\. conveyor\.init\(timeout=300\)$"):
        conveyor.init(timeout=timeout)


@pytest.mark.parametrize("text", ["-1", "0", "abc", "nan", ""])
def test_a_bad_conveyor_timeout_is_refused(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_TIMEOUT", text)
    with pytest.raises(conveyor.ConfigError, match=r"^\$CONVEYOR_TIMEOUT must be a finite"):
        conveyor.init()
    monkeypatch.setenv("CONVEYOR_TIMEOUT", "2.5")
    assert conveyor.init().timeout == 2.5


# --- 3, 5, 1 under a launch: two real processes -------------------------------------------


def _launched(rank: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, timeout, env in (("argument", -5.0, None), ("variable", None, "abc")):
        if env is not None:
            os.environ["CONVEYOR_TIMEOUT"] = env
        try:
            conveyor.init(timeout=timeout)
        except conveyor.ConfigError as e:
            out[key] = f"{e} (group made: {dist.is_initialized()})"
        os.environ.pop("CONVEYOR_TIMEOUT", None)
    ctx = conveyor.init(timeout=3)
    try:
        conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2,
                          balance=[4, 4, 5], context=ctx)
    except conveyor.ConfigError as e:
        out["balance"] = str(e)
    # A batch only the rank holding stage 0 passes (the others pass None) is bad: the
    # model is captured on it, so every rank gets its error, none waits for the batch.
    pipe = conveyor.Pipeline(_SizeBranch(), loss_fn=None, microbatches=2, context=ctx)
    bad = {"x": torch.randn(4, 8), "extra": torch.randn(3, 8)} if rank == 0 else None
    try:
        pipe.predict(bad)
    except conveyor.ConveyorError as e:
        out["sample"] = f"{type(e).__name__}: {e}"
    pipe = conveyor.Pipeline(_digits_model(), loss_fn=nn.functional.cross_entropy,
                             microbatches=2, balance=[2, 2], context=ctx)
    pipe.train_step(*_digits(4))
    try:
        pipe.train_step(*_digits(4, side=7))
    except conveyor.PipelineError as e:
        out["step"] = str(e)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_edges_on_two_processes() -> None:
    results = distributed.run(_launched, 2, timeout=120)
    for rank, got in enumerate(results):
        assert got["argument"] == (
            "timeout must be a finite number of seconds > 0, got timeout=-5.0; pass e.g. "
            "conveyor.init(timeout=300) (group made: False)"
        ), got
        assert got["variable"].startswith("$CONVEYOR_TIMEOUT must be a finite number"), got
        assert got["variable"].endswith("(group made: False)"), got
        assert got["balance"] == (
            "balance [4, 4, 5] describes 3 stages, but this run has 2 pipeline ranks x 1 "
            "chunk(s) = 2 stages; launch 3 processes for 3 pipeline ranks (conveyor launch "
            "--nproc-per-node 3 script.py), or give balance 2 entries"
        ), rank
    assert results[0]["sample"] == results[1]["sample"] == (
        "ConfigError: inputs tensors must share their first (batch) dimension, got sizes [3, 4]"
    ), results
    # The failing rank names its work; the other one stops on its time-out, naming it.
    assert results[0]["step"].startswith(
        "rank 0: the forward of stage 0 (modules 0-1) on micro-batch 0 raised RuntimeError: "
        "mat1 and mat2 shapes cannot be multiplied (2x49 and 64x32);"
    ), results[0]
    assert "rank 0" in results[1]["step"] and "3 s" in results[1]["step"], results[1]


# --- 9. a construction error reaches every rank of a pp x tp mesh --------------------------


def _tp_errors(rank: int) -> list[str]:
    from torch.distributed.tensor.parallel import ColwiseParallel

    ctx = conveyor.init(pp=2, tp=2, timeout=60)
    out = []
    for name in ("0", "2"):  # a module of stage 0 (ranks 0, 1), then of stage 1 (ranks 2, 3)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 5))
        try:
            conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=2,
                              balance=[2, 1], tp_plan={name: ColwiseParallel()}, context=ctx)
            out.append("built")
        except conveyor.ConfigError as e:
            out.append(str(e))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_tp_plan_error_reaches_every_rank_alike() -> None:
    results = distributed.run(_tp_errors, 4, timeout=180)
    assert all(r == results[0] for r in results), results
    first, second = results[0]
    assert first.startswith("tp_plan cannot shard model.0: ColwiseParallel splits its "
                            "out_features = 15 over tp = 2 ranks"), first
    assert second.startswith("tp_plan cannot shard model.2: ColwiseParallel splits its "
                             "out_features = 5 over tp = 2 ranks"), second


# --- 4. the launcher's rendezvous edges ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_static_rendezvous_with_restarts_on_several_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.run

    def started(config: Any) -> None:
        raise AssertionError("torchrun started: the static rendezvous waits for the other node")

    monkeypatch.setattr(torch.distributed.run, "run", started)
    for name in ("OMP_NUM_THREADS", *conveyor.cli.launch.MALLOC_TUNABLES):
        monkeypatch.delenv(name, raising=False)  # the launcher sets them; restored after
    argv = ["launch", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--max-restarts", "1", "--nproc-per-node", "1", "train.py"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("conveyor launch: error: --max-restarts 1 with --nnodes 2 needs the "
                          "c10d rendezvous"), err
    assert "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB" in err


def test_launch_help_shows_two_machines(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    example = out.index("two machines")
    assert example < out.index("--nproc-per-node NPROC_PER_NODE")
    command = " ".join(out[example:].split("\n\n")[0].replace("\\\n", " ").split())
    assert ("conveyor launch --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "
            "HOST:29400 --rdzv-id job1") in command


def test_rendezvous_summary_formats_torchs_errors() -> None:
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    config = conveyor.cli.launch._parser().parse_args(
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host0:29400",
         "--rdzv-conf", "join_timeout=20", "train.py"]
    )
    summary = conveyor.cli.launch.rendezvous_summary(RendezvousTimeoutError(), config)
    lines = summary.splitlines()
    assert len(lines) <= 4 and all(len(line) <= 100 for line in lines)
    assert " ".join(line.strip() for line in lines) == (
        "conveyor launch: the c10d rendezvous at host0:29400 did not gather --nnodes 2 nodes "
        "within join_timeout=20 s; start conveyor launch on every node with the same --nnodes, "
        "--rdzv-endpoint and --rdzv-id, and check that host0:29400 is reachable from each"
    )
    refused = RendezvousConnectionError(
        "The connection to the C10d store has failed. See inner exception for details."
    )
    lines = conveyor.cli.launch.rendezvous_summary(refused, config).splitlines()
    assert len(lines) <= 4 and all(len(line) <= 100 for line in lines)
    assert " ".join(line.strip() for line in lines) == (
        "conveyor launch: the c10d rendezvous at host0:29400 failed: RendezvousConnectionError: "
        "The connection to the C10d store has failed. See inner exception for details; start "
        "conveyor launch on every node with the same --nnodes, --rdzv-endpoint and --rdzv-id, "
        "and check that host0:29400 is reachable from each"
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_c10d_peer_that_never_arrives_ends_with_the_summary(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.launch", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "edge",
         "--rdzv-conf", "join_timeout=3", str(script)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "never runs" not in proc.stdout, proc.stderr
    tail = " ".join(proc.stderr.split("conveyor launch: ", 1)[-1].split())
    assert tail.startswith(
        f"the c10d rendezvous at 127.0.0.1:{port} did not gather --nnodes 2 nodes within "
        f"join_timeout=3 s;"
    ), proc.stderr


# --- 7, 8. the README's Use snippet, and threads for one-process runs ----------------------

USE = "import torch, conveyor\nfrom torch import nn"


def test_the_use_snippet_is_seeded_and_prints_its_loss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = readme_snippet(USE)
    printed = []
    for _ in range(2):
        reset_context()  # a fresh script
        exec(compile(code, "README.md", "exec"), {})
        printed.append(capsys.readouterr().out)
    lines = printed[0].splitlines()
    assert len(lines) == 3 and all(re.fullmatch(r"loss \d+\.\d{4}", line) for line in lines)
    assert printed[1] == printed[0]  # seeded: every run (and every rank) has the same data


def test_the_readme_says_what_to_set_for_one_process_runs() -> None:
    text = (ROOT / "README.md").read_text()
    use = text.split("## Use", 1)[1].split("\n## ", 1)[0]
    commands = [" ".join(c.split()) for c in re.findall(r"`([^`]+python train\.py)`", use)]
    assert commands, "the Use section should say what to set for python train.py"
    words = shlex.split(commands[0])
    assert words[-2:] == ["python", "train.py"]
    settings = dict(word.split("=", 1) for word in words[:-2])
    want = {"OMP_NUM_THREADS": "1"} | {n: str(1 << 30) for n in conveyor.cli.launch.MALLOC_TUNABLES}
    assert settings == want  # exactly what conveyor launch sets
