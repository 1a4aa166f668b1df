"""ResNet-50 on CIFAR-10, split the MindSpore way: pipeline_stage on layer groups.

    python examples/resnet.py --data cifar-10-batches-bin       # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/resnet.py --data cifar-10-batches-bin
    python examples/resnet.py --steps 5                          # no data: random images
    conveyor launch --nproc-per-node 2 --max-restarts 3 examples/resnet.py \\
        --data cifar-10-batches-bin --checkpoint ckpt            # survives a lost process

--data is the folder of the "CIFAR-10 binary version": download
https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz (162 MB) and extract it
(tar xzf cifar-10-binary.tar.gz) to get cifar-10-batches-bin/ with data_batch_1.bin ...
data_batch_5.bin and test_batch.bin (records of one label byte and 3072 pixel bytes).
Without --data the example trains on random images of the same shape: that shows the
pipeline running but learns nothing (the loss stays near ln 10 = 2.3). ResNet-50 is
defined here (there is no torchvision on this machine).

The loop is conveyor.Trainer's, as in the seeds' tutorials (Colossal-AI's
Trainer(engine).fit(train_dataloader, epochs, test_dataloader, hooks=[LossHook(),
AccuracyHook(), LRSchedulerHook(...)]), MindSpore's Model(net).train(epochs, dataset,
callbacks=[LossMonitor()])): SGD with momentum and a cosine learning-rate schedule, the
whole model's gradient norm clipped to --clip (without it the first steps of an un-warmed
ResNet-50 at this learning rate can throw the loss from 2.3 to 40), a progress line a
tenth of the way, then the held-out accuracy (the "accuracy" metric on the last stage,
reported on every rank).

With --checkpoint DIR the run saves every --save-every steps (model, batch-norm
statistics, optimizer, schedule, data order) and, started again, resumes from DIR exactly
where it stopped: each epoch's shuffle is drawn from (seed, epoch), so nothing is repeated
or skipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import conveyor
from conveyor.schedules import check_chunks
from conveyor.training import ProgressBar

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, inp: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(inp, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            if stride != 1 or inp != out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-50 (blocks 3, 4, 6, 3) with a CIFAR stem (3x3 conv, no max-pool)."""

    def __init__(
        self, blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 64, classes: int = 10
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, base, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        inp = base
        layers = []
        for i, n in enumerate(blocks):
            width = base * 2**i
            group = []
            for j in range(n):
                group.append(Bottleneck(inp, width, 2 if j == 0 and i > 0 else 1))
                inp = width * Bottleneck.expansion
            layers.append(nn.Sequential(*group))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(inp, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def annotate(model: ResNet, stages: int) -> None:
    """Layer groups onto stages, MindSpore style; the stem follows layer1, fc follows layer4."""
    groups = [model.layer1, model.layer2, model.layer3, model.layer4]
    if stages <= 4:
        for i, group in enumerate(groups):
            group.pipeline_stage = i * stages // 4  # type: ignore[assignment]
        return
    blocks = [b for g in groups for b in g]
    if stages > len(blocks):
        raise SystemExit(f"ResNet-50 has {len(blocks)} blocks; use at most that many stages")
    for i, block in enumerate(blocks):
        block.pipeline_stage = i * stages // len(blocks)  # type: ignore[assignment]


def load_cifar(folder: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 3, 32, 32) normalised, and labels, from CIFAR-10's binary files."""
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if train else ["test_batch.bin"]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise SystemExit(
            f"{folder} has no {missing[0]}: --data wants the folder cifar-10-batches-bin/ "
            "extracted from https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz "
            "(the CIFAR-10 binary version)"
        )
    raw = np.concatenate([np.fromfile(folder / n, dtype=np.uint8) for n in names])
    records = raw.reshape(-1, 3073)
    labels = torch.from_numpy(records[:, 0].astype(np.int64))
    images = torch.from_numpy(records[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32)) / 255
    return (images - MEAN) / STD, labels


def random_cifar(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random data with CIFAR-10's shapes, for runs without ``--data``."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 32, 32, generator=gen), torch.randint(10, (n,), generator=gen)


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as it is written, and each option's default."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument(
        "--data",
        type=Path,
        metavar="DIR",
        help="the cifar-10-batches-bin folder; None: random images",
    )
    ap.add_argument("--pp", type=int, help="pipeline ranks; None: the processes, or 2 alone")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule")
    ap.add_argument("--chunks", type=int, help="stages per rank; None: the schedule's")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--batch-size", type=int, default=64, help="images per step")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps; 0: one epoch")
    ap.add_argument(
        "--base",
        type=int,
        default=64,
        help="width of the first layer group (the default is ResNet-50's)",
    )
    ap.add_argument(
        "--blocks",
        default="3,4,6,3",
        help="bottleneck blocks per layer group (the default is ResNet-50's)",
    )
    ap.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    ap.add_argument(
        "--clip", type=float, default=1.0, help="largest gradient norm, 0 for no clipping"
    )
    ap.add_argument("--checkpoint", metavar="DIR", help="save to and resume from DIR")
    ap.add_argument("--save-every", type=int, default=50, metavar="K", help="steps between saves")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    ctx = conveyor.init(pp=args.pp or (None if dist.is_torchelastic_launched() else 2))
    say = print if ctx.rank == 0 else (lambda *a: None)
    if args.data is not None:
        x_train, y_train = load_cifar(args.data, train=True)
        x_test, y_test = load_cifar(args.data, train=False)
    else:
        say(
            "no --data: training on random images, which teaches nothing; for CIFAR-10 get "
            "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz, extract it and pass "
            "--data cifar-10-batches-bin"
        )
        x_train, y_train = random_cifar(args.batch_size * max(args.steps, 1))
        x_test, y_test = random_cifar(args.batch_size)
    model = ResNet(tuple(int(b) for b in args.blocks.split(",")), args.base)
    chunks = check_chunks(args.schedule, args.chunks, flags=True)
    annotate(model, ctx.pp_size * chunks)
    pipe = conveyor.Pipeline(
        model,
        loss_fn=F.cross_entropy,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=chunks,
        context=ctx,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    say(
        f"ResNet: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{'CIFAR-10' if args.data else 'random data'}: {len(x_train)} images"
    )
    say(pipe)
    per_epoch = len(x_train) // args.batch_size
    steps = min(per_epoch, args.steps) if args.steps else per_epoch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    fit = conveyor.Trainer(
        pipe,
        opt,
        lr_scheduler=sched,
        max_grad_norm=args.clip or None,
        callbacks=[ProgressBar()],  # a line a tenth of the way
        checkpoint_dir=args.checkpoint,
        checkpoint_every=args.save_every if args.checkpoint else None,
    )
    fit.fit(
        TensorDataset(x_train, y_train),
        batch_size=args.batch_size,
        max_steps=steps,
        resume=args.checkpoint is not None,
    )
    # Batch norm uses its running statistics here (evaluate switches the stages to eval).
    held_out = fit.evaluate(
        TensorDataset(x_test, y_test), batch_size=args.batch_size, metrics=["accuracy"]
    )
    say(f"held-out accuracy {held_out['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
