"""Check conveyor on this machine's devices: every schedule against the unsplit model.

``conveyor launch --nproc-per-node N -m conveyor.verify`` (N >= 2; on GPUs, NCCL) trains
a small model with skip connections through every schedule for two steps whose batch
sizes differ, then runs ``eval_step`` and ``predict``, and compares each step's loss and
every gradient with the unsplit model trained on this rank's device. Prints one line per
schedule on rank 0 and exits 1 if any differs by more than ``--tolerance`` (relative to
the largest value of each gradient) or if a step fails; a hang becomes a
:class:`~conveyor.errors.PipelineError` naming the rank and action within ``--timeout``.

``--compile [BACKEND]`` adds a compiled pass (``Pipeline(compile=...)``, inductor unless
another backend is named): every schedule again with compiled stages, within
``--compile-tolerance`` (compilers round differently), and fails where a rank ran no
compiled code.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import conveyor
from conveyor.runtime.compiled import frames_compiled
from conveyor.schedules import SCHEDULE_NAMES, default_chunks


class Block(nn.Module):
    """A residual MLP block: ``x + fc2(tanh(fc1(x)))``.

    ``fc1`` and ``fc2`` are the layer names a ``tp_plan`` would give.

    Args:
        width: Features in and out; the hidden layer has twice as many.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: Shape ``(batch, width)``.

        Returns:
            ``x + fc2(tanh(fc1(x)))``, the same shape.
        """
        out: torch.Tensor = x + self.fc2(torch.tanh(self.fc1(x)))
        return out


class SkipNet(nn.Module):
    """Blocks that all read the first layer's output: a skip across every cut.

    Args:
        depth: How many blocks (:class:`Block`).
        width: Features between the layers.
        inputs: Input features.
        outputs: Output features.
    """

    def __init__(self, depth: int, width: int = 32, inputs: int = 16, outputs: int = 8) -> None:
        super().__init__()
        self.first = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the network.

        Args:
            x: Shape ``(batch, inputs)``.

        Returns:
            Shape ``(batch, outputs)``.
        """
        h0 = torch.tanh(self.first(x))
        h = h0
        for block in self.blocks:
            h = block(h) + h0
        out: torch.Tensor = self.head(h)
        return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of ``a`` and ``b``, relative to ``b``'s largest value."""
    scale = b.abs().max().item()
    return float((a - b).abs().max().item() / scale) if scale > 0 else float((a - b).abs().max())


def _check(
    name: str, ctx: conveyor.Context, microbatches: int, backend: str | None = None
) -> tuple[float, float]:
    """Worst relative difference of ``name`` against the unsplit model, and ms per step;
    with ``backend``, compiled stages (worst is infinite where none compiled here)."""
    chunks = default_chunks(name)
    depth = 2 * ctx.pp_size * chunks
    torch.manual_seed(0)
    reference = SkipNet(depth).to(ctx.device)
    torch.manual_seed(0)
    pipe = conveyor.Pipeline(
        SkipNet(depth).to(ctx.device),
        loss_fn=nn.functional.mse_loss,
        microbatches=microbatches,
        schedule=name,
        chunks=chunks,
        context=ctx,
        compile=False if backend is None else {"backend": backend},
    )
    frames = frames_compiled()
    worst, elapsed = 0.0, 0.0
    reference_params = dict(reference.named_parameters())
    for step, size in enumerate((4 * microbatches, 3 * microbatches + 1)):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(size, 16, generator=generator).to(ctx.device)
        y = torch.randn(size, 8, generator=generator).to(ctx.device)
        start = time.perf_counter()
        loss = pipe.train_step(x, y)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        elapsed += time.perf_counter() - start
        reference.zero_grad()
        want = nn.functional.mse_loss(reference(x), y)
        torch.autograd.backward(want)
        worst = max(worst, abs(loss.item() - want.item()) / max(abs(want.item()), 1e-12))
        for pname, param in pipe.named_parameters():
            got, expected = param.grad, reference_params[pname].grad
            assert got is not None and expected is not None
            worst = max(worst, _relative(got, expected))
        for param in pipe.parameters():
            param.grad = None
    with torch.no_grad():
        want = nn.functional.mse_loss(reference(x), y)
        worst = max(worst, abs(pipe.eval_step(x, y).item() - want.item()) / abs(want.item()))
        out = pipe.predict(x)
        if out is not None:
            worst = max(worst, _relative(out, reference(x)))
    if backend is not None and frames_compiled() == frames:
        worst = float("inf")  # no compiled code ran on this rank
    return worst, elapsed * 1000 / 2


def main(argv: list[str] | None = None) -> int:
    """Run the check on every rank (launched with ``conveyor launch``).

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``): ``--schedules``,
            ``--microbatches``, ``--tolerance``, ``--timeout``, ``--compile [BACKEND]``,
            ``--compile-tolerance``.

    Returns:
        The exit code: 0 if every schedule matches the unsplit model, else 1.

    Raises:
        ConfigError: For an unknown name in ``--schedules``.
        PipelineError: If a rank fails or stalls past ``--timeout`` seconds during a step.
    """
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.verify",
        description="Every schedule's losses and gradients against the unsplit model, on "
        "this machine's devices (launch with conveyor launch --nproc-per-node N).",
    )
    parser.add_argument(
        "--schedules",
        default=",".join(SCHEDULE_NAMES),
        help="comma-separated schedule names (default: all)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=0,
        help="micro-batches per step (default: 2 x pipeline ranks)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest relative difference accepted (default: 1e-5)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="seconds before a stalled rank is reported (default: 120)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="also a pass with compiled stages",
    )
    parser.add_argument(
        "--compile-tolerance",
        type=float,
        default=1e-4,
        help="largest relative difference of the compiled pass (1e-4)",
    )
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    torch.backends.cudnn.allow_tf32 = False
    ctx = conveyor.init(timeout=args.timeout)
    if ctx.rank == 0:
        setup = f"{ctx.world_size} processes, {ctx.backend} on {ctx.device.type}"
        print(f"conveyor.verify: {setup}, pp={ctx.pp_size} dp={ctx.dp_size}", flush=True)
    microbatches = args.microbatches or 2 * ctx.pp_size
    failed = False
    passes = [(None, args.tolerance)]
    if args.compile is not None:
        passes.append((args.compile, args.compile_tolerance))
    for (backend, tolerance), name in ((p, n) for p in passes for n in args.schedules.split(",")):
        worst, ms = _check(name.strip(), ctx, microbatches, backend)
        if ctx.distributed:
            buf = torch.tensor([worst], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            worst = float(buf.item())
        ok = worst <= tolerance
        failed |= not ok
        if ctx.rank == 0:
            verdict = "ok" if ok else "DIFFERS"
            label = name if backend is None else f"{name} compiled"
            print(
                f"  {label:<27} {verdict:<8} max relative difference {worst:.1e}  "
                f"{ms:8.1f} ms/step",
                flush=True,
            )
    if ctx.rank == 0:
        print("conveyor.verify: " + ("FAILED" if failed else "every schedule matches"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
