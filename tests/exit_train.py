"""A short training whose process must exit 0 (tests/test_exit.py). Before anything else
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
    os.write(sys.stdout.fileno(), line.encode())


atexit.register(_threads_left)  # before conveyor registers its hook, so it runs after it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import conveyor  # noqa: E402


def starve_other_threads() -> None:
    """The lowest priority (nice 19) for every thread of this process but the calling
    one."""
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            with contextlib.suppress(OSError):  # the thread may have ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)


def main(schedule: str, destroy: bool) -> None:
    ctx = conveyor.init()
    starve_other_threads()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    pipe = conveyor.Pipeline(
        model, loss_fn=nn.functional.mse_loss, microbatches=4, schedule=schedule, context=ctx
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        loss = pipe.train_step(torch.randn(16, 32), torch.randn(16, 32))
        opt.step()
        opt.zero_grad()
    starve_other_threads()  # threads started during training too
    bubble = pipe.measured_bubble()  # all-reduces (on tensors Python owns), as the demo does
    if ctx.rank == 0:
        print(f"trained {schedule}: loss {float(loss):.4f}, bubble {bubble:.2f}", flush=True)
    if destroy:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["destroy"])
