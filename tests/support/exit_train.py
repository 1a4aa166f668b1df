"""A short training whose process must exit 0 (tests/parallel/test_exit.py).

    torchrun --nproc-per-node N tests/support/exit_train.py SCHEDULE LAYOUT [destroy]

LAYOUT: ``pp`` (pp2, 2 processes), ``dp`` (pp2 x dp2, 4), ``fsdp`` (pp2 x dp2 with
``fsdp=True``, 4), ``tp`` (pp2 x tp2 with a ``tp_plan``, 4) or ``3d`` (pp2 x dp2 x tp2 with
both, 8). With ``$EXIT_TRAIN_CPU`` set, every thread of the process is pinned to that CPU
once the imports are done, before ``conveyor.init`` starts a gloo thread (those inherit it):
the process group's whole life, training and exit, runs there, while the imports, which no
group sees, use every CPU. Before anything else
it registers an exit handler that prints how many threads the process has once conveyor's
exit hook has run (handlers run last-registered first): how many gloo worker threads are
left, 2 per process group still alive.
After conveyor.init
every thread but the main one gets the lowest priority, so that gloo's worker threads
finish their last works late, as on a loaded machine."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def _threads_left() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    workers = names.count("pt_gloo_runloop")
    rank = os.environ.get("RANK")
    # One write of the whole line: the two ranks share the pipe, and print's text and
    # newline, written apart, can interleave with the other rank's line.
    sys.stdout.flush()
    line = f"rank {rank}: gloo workers after the exit hooks: {workers}\n"
    cpus: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread may have ended meanwhile
            cpus |= os.sched_getaffinity(int(tid))
    line += f"rank {rank}: threads on cpus {sorted(cpus)}\n"
    os.write(sys.stdout.fileno(), line.encode())


atexit.register(_threads_left)  # before conveyor registers its hook, so it runs after it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402


def pin_to_cpu() -> None:
    """Every thread of this process (the ones started later inherit it) on the CPU
    ``$EXIT_TRAIN_CPU`` names, if it names one."""
    cpu = os.environ.get("EXIT_TRAIN_CPU")
    if cpu is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread may have ended meanwhile
            os.sched_setaffinity(int(tid), {int(cpu)})


def starve_other_threads() -> None:
    """The lowest priority (nice 19) for every thread of this process but the calling
    one."""
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            with contextlib.suppress(OSError):  # the thread may have ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)


LAYOUTS = {"pp": (1, 1), "dp": (2, 1), "fsdp": (2, 1), "tp": (1, 2), "3d": (2, 2)}
"""dp and tp of each layout (pp is 2)."""


def main(schedule: str, layout: str, destroy: bool) -> tuple[object, object]:
    """Train 3 steps; returns the pipeline and optimizer, which the script keeps to its end
    as a script holding them in globals does (FSDP's and DTensor's objects reach the mesh's
    process groups through them)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dp, tp = LAYOUTS[layout]
    pin_to_cpu()
    ctx = conveyor.init(pp=2, dp=dp, tp=tp, timeout=60)
    starve_other_threads()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    options: dict[str, object] = {}
    if layout in ("fsdp", "3d"):
        options["fsdp"] = True
    if tp > 1:  # each stage's two layers: columns, then rows
        options["tp_plan"] = {"[02]": ColwiseParallel(), "[13]": RowwiseParallel()}
    pipe = conveyor.Pipeline(
        model,
        loss_fn=nn.functional.mse_loss,
        microbatches=4,
        schedule=schedule,
        context=ctx,
        **options,  # type: ignore[arg-type]
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        loss = pipe.train_step(torch.randn(16, 32), torch.randn(16, 32))
        opt.step()
        opt.zero_grad()
    starve_other_threads()  # threads started during training too
    bubble = pipe.measured_bubble()  # all-reduces (on tensors Python owns), as the demo does
    if ctx.rank == 0:
        print(f"trained {schedule} {layout}: loss {float(loss):.4f}, bubble {bubble:.2f}")
    sys.stdout.flush()
    if destroy:
        dist.barrier()
        dist.destroy_process_group()
    return pipe, opt


if __name__ == "__main__":
    kept = main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["destroy"])
