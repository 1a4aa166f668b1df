"""``conveyor plan --model CONFIG --hardware NAME --gpus N --seq S --global-batch B``.

Ranks every layout of the model on a cluster nobody has to own
(:func:`conveyor.planning.search.rank_layouts`, simulating only those that can make the
printed top), prints the fastest ones with their memory
per GPU (those over the limit marked), and the best as the keywords that run it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError

TOP = 15
"""Layouts printed by default."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster flags of ``conveyor plan``."""
    parser.add_argument(
        "--model",
        metavar="CONFIG",
        help="a transformers config.json (or the folder holding it): plan a cluster for it",
    )
    parser.add_argument(
        "--hardware", default="h100-sxm", metavar="NAME", help="a100-80g, h100-sxm or h200"
    )
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs in the cluster")
    parser.add_argument("--seq", type=int, metavar="S", help="tokens per sequence")
    parser.add_argument(
        "--global-batch", type=int, metavar="B", help="sequences per step over all replicas"
    )
    parser.add_argument(
        "--top", type=int, default=TOP, metavar="K", help=f"layouts to print (default {TOP})"
    )


def load_config(path: str) -> Any:
    """The transformers config at ``path`` (a config.json or its folder), read offline.

    Raises:
        ConfigError: If there is no such file, or transformers cannot read it.
    """
    from transformers import AutoConfig

    where = Path(path)
    if not (where.is_file() or (where / "config.json").is_file()):
        raise ConfigError(
            f"no config at {path}; pass a transformers config.json or the folder holding it"
        )
    try:  # a file is read as it is, a folder's config.json otherwise
        return AutoConfig.from_pretrained(str(where), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"transformers cannot read the config at {path}: {error}") from None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Rank the layouts and print them; the exit code (0, or 2 when none fits)."""
    from conveyor.planning.search import rank_layouts

    for flag in ("gpus", "seq", "global_batch"):
        if getattr(args, flag) is None:
            parser.error(f"--model needs --{flag.replace('_', '-')}")
    if args.top < 1:
        parser.error(f"--top must be an integer >= 1, got {args.top}")
    start = time.perf_counter()
    ranked = rank_layouts(
        load_config(args.model),
        hardware=args.hardware,
        gpus=args.gpus,
        seq=args.seq,
        global_batch=args.global_batch,
        memory_limit_gb=args.memory_limit,
        top=args.top,
    )
    seconds = time.perf_counter() - start
    hw = ranked[0].estimate.hardware
    limit = hw.hbm_gb if args.memory_limit is None else args.memory_limit
    over = sum(not r.fits for r in ranked)
    print(
        f"the {len(ranked)} fastest layouts of {args.gpus} x {hw.name or 'GPU'} ranked in "
        f"{seconds:.1f} s; {over} of them over the {limit:g} GB limit"
    )
    print(table(ranked, limit))
    best = ranked[0]
    if not best.fits:
        smallest = min(ranked, key=lambda r: r.estimate.memory_gb)
        print(
            f"conveyor plan: error: no layout fits {limit:g} GB per GPU (the smallest of "
            f"these needs {smallest.estimate.memory_gb:.1f} GB); use more GPUs, a smaller "
            "global batch or raise --memory-limit"
        )
        return 2
    print(f"best: {keywords(best)}")
    return 0


def table(ranked: list[Any], limit: float) -> str:
    """The ranked layouts as a markdown table."""
    head = (
        "| # | pp | tp | cp | dp | ep | fsdp | schedule | chunks | mbs | recompute "
        "| tokens/s/GPU | MFU | step s | bubble | GB/GPU |"
    )
    rows = [head, "|" + "---|" * 16]
    for i, r in enumerate(ranked, 1):
        e, lay = r.estimate, r.layout
        mark = "" if r.fits else f" over {limit:g}"
        fsdp = {False: "no", True: "yes"}.get(lay.fsdp, str(lay.fsdp))
        rows.append(
            f"| {i} | {lay.pp} | {lay.tp} | {lay.cp} | {lay.dp} | {lay.ep} | {fsdp} "
            f"| {lay.schedule} | {lay.chunks} | {lay.microbatch_size} "
            f"| {'yes' if lay.recompute else 'no'} | {e.tokens_per_s_per_gpu:.0f} "
            f"| {e.mfu:.3f} | {e.step_s:.2f} | {e.bubble:.3f} | {e.memory_gb:.1f}{mark} |"
        )
    return "\n".join(rows)


def keywords(ranked: Any) -> str:
    """The ``conveyor.init`` and ``Pipeline`` keywords that run a layout."""
    lay = ranked.layout
    init = f"conveyor.init(pp={lay.pp}, dp={lay.dp}, tp={lay.tp}"
    init += (f", cp={lay.cp}" if lay.cp > 1 else "") + (f", ep={lay.ep})" if lay.ep > 1 else ")")
    pipe = f"Pipeline(model, loss_fn=..., microbatches={lay.microbatches}"
    pipe += f', schedule="{lay.schedule}"'
    pipe += f", chunks={lay.chunks}" if lay.chunks > 1 else ""
    pipe += {True: ", fsdp=True", "reshard": ', fsdp="reshard"'}.get(lay.fsdp, "")
    pipe += ", tp_plan=..." if lay.tp > 1 else ""
    pipe += ", recompute=True" if lay.recompute else ""
    per_replica = lay.microbatch_size * lay.microbatches
    return f"{init}; {pipe}) with {per_replica} sequences per replica per step"
