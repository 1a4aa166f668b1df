"""Models too big for one process: peak memory per rank and time to the first step of a
Llama built whole on every rank, built on the meta device and initialized per rank, and
built on the meta device and loaded per rank from a sharded transformers checkpoint; and
peak memory per rank and time to save it as a transformers checkpoint, per rank
(``conveyor.save_pretrained``) against the whole model gathered into rank 0.

    python benchmarks/big_model.py [--pp 2,4] [--paths whole,init,load,save,gather]
                                   [--layers 20] [--hidden 1024] [--json FILE] [--quick]
                                   [--together] [--keep DIR]

The model: a transformers ``LlamaForCausalLM`` built from a ``LlamaConfig`` (nothing
downloaded; default hidden 1024, 20 layers, intermediate 2816, vocabulary 32000, untied
embeddings: 322M parameters, 1.29 GB in fp32), ``use_cache=False``. One training step
(``loss_fn=None``, the model's own loss from ``labels``; batch 4 x 64 tokens in 4
micro-batches, 1F1B, then SGD) on ``pp`` processes (``conveyor launch``, gloo, one thread
each). The three paths:

- ``whole``: ``torch.manual_seed(0); LlamaForCausalLM(config)`` on every rank, then
  ``Pipeline(model, ...)`` (the model built whole, then split);
- ``init``: built under ``conveyor.empty_weights()``, ``Pipeline(..., weights=None)``: each
  rank initializes only its own stages;
- ``load``: built under ``conveyor.empty_weights()``, ``Pipeline(..., weights=DIR)``: each
  rank reads only its own tensors from ``DIR``, the ``whole`` model saved beforehand by
  ``save_pretrained(DIR, max_shard_size=...)`` (sharded safetensors; the save is timed on
  its own, outside the runs), so its loss equals the ``whole`` path's;
- ``save``: built as ``init`` (no step), then ``conveyor.save_pretrained(pipe, DIR,
  max_shard_size=...)`` on every rank: each writes the tensors it holds;
- ``gather``: built as ``init`` (no step), then what ``PipelineTrainer.save_model`` did: the
  whole state dict gathered into rank 0 (``conveyor.integrations._hf_model.
  gather_state_dict``), which writes it with transformers' ``model.save_pretrained(DIR,
  state_dict=..., max_shard_size=...)``.

Each rank reports its peak resident memory (``VmHWM`` of ``/proc/self/status``) at the end
of its first step and once ``Pipeline(..., sample=)`` has split the model and given its
stages their values ("built"), the seconds from its process start to both, and its share:
parameters + gradients of its own stages (``pipe.parameters()``), the least a rank can
hold. Each path and pp runs in fresh processes, one after another (``--together``: the
paths of one pp at once, for a quick test; their times then mean nothing), each only if
an estimate of its memory fits in what the machine has available. The checkpoint goes to
a temporary directory (under ``$BIG_MODEL_DIR`` if set). Prints a markdown table;
``--json`` writes every number.

The two save paths report, per rank, instead of a step: ``VmRSS`` and ``VmHWM`` just before
the save (after a barrier) and ``VmHWM`` and ``VmRSS`` after it (the peak is never reset:
``VmHWM`` after minus ``VmRSS`` before bounds what the save itself held at once, exactly
when the peak grew), the seconds of the save on that rank (``gather``: the gather, and on
rank 0 the write), its share (its parameters) and the model's largest tensor. The
directories they write go to the temporary directory, or are kept under ``--keep DIR``
(``DIR/save-pp2``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import status_kib

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("whole", "init", "load", "save", "gather")
SAVES = ("save", "gather")  # paths that save instead of stepping
MIB = 2**20
SHARD = "200MB"  # save_pretrained's max_shard_size: a 1.3 GB model is 7 files
QUICK = {"hidden": 512, "layers": 2, "intermediate": 1376, "vocab": 32000, "heads": 8,
         "batch": 2, "tokens": 16, "microbatches": 2}  # fmt: skip
FULL = {"hidden": 1024, "layers": 20, "intermediate": 2816, "vocab": 32000, "heads": 16,
        "batch": 4, "tokens": 64, "microbatches": 4}  # fmt: skip


def since_start() -> float:
    """Seconds since this process started (its ``/proc/self/stat`` start time)."""
    stat = Path("/proc/self/stat").read_text()
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def config(shape: dict[str, int]) -> Any:
    """The benchmark's ``LlamaConfig``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=max(64, shape["tokens"]),
        tie_word_embeddings=False,
        use_cache=False,
    )


def build_whole(shape: dict[str, int]) -> Any:
    """The model with real weights: the same values on every call (saved for ``load``)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config(shape))


def batch(shape: dict[str, int]) -> dict[str, Any]:
    """The step's inputs: random token ids, the labels the same ids (the model shifts)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["tokens"]), generator=gen)
    return {"input_ids": ids, "labels": ids}


def worker(args: argparse.Namespace) -> None:
    """One rank of one run: build, split, one step; write this rank's numbers."""
    import torch
    from transformers import LlamaForCausalLM

    import conveyor

    torch.set_num_threads(1)
    shape = json.loads(args.shape)
    ctx = conveyor.init()
    imports = status_kib("VmHWM")  # the interpreter, torch, transformers, the process group
    imported_at = since_start()
    if args.run == "whole":
        model, weights = build_whole(shape), None
    else:  # init, load and both saves
        with conveyor.empty_weights():
            model = LlamaForCausalLM(config(shape))
        weights = args.weights if args.run == "load" else None
    data = batch(shape)
    # sample= splits the model and gives this rank's stages their values here, so the
    # build's peak and the step's can be told apart.
    pipe = conveyor.Pipeline(
        model, loss_fn=None, microbatches=shape["microbatches"], schedule="1f1b",
        context=ctx, weights=weights, init_seed=0, sample=(data, None),
    )  # fmt: skip
    built, built_at = status_kib("VmHWM"), since_start()
    if args.run in SAVES:
        report = save_run(args.run, pipe, model, args.weights, ctx)
        report.update(imports=imports * 1024, built=built * 1024, built_seconds=built_at)
        Path(args.out, f"{ctx.rank}.json").write_text(json.dumps(report))
        return
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    loss = pipe.train_step(data, None)
    opt.step()
    seconds, peak = since_start(), status_kib("VmHWM")
    held = {id(p) for p in pipe.parameters()}
    share = sum(p.numel() * p.element_size() for p in pipe.parameters())
    elsewhere = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if not p.is_meta and id(p) not in held
    )
    report = {
        "rank": ctx.rank, "peak": peak * 1024, "imports": imports * 1024,
        "built": built * 1024, "file": status_kib("RssFile") * 1024,
        "share": 2 * share, "params": share, "real_elsewhere": elsewhere,
        "imported_seconds": imported_at, "built_seconds": built_at, "seconds": seconds,
        "loss": float(loss),
    }  # fmt: skip
    Path(args.out, f"{ctx.rank}.json").write_text(json.dumps(report))


def save_run(run: str, pipe: Any, model: Any, where: str, ctx: Any) -> dict[str, Any]:
    """Save the pipeline's model to ``where`` per rank (``save``) or gathered into rank 0
    (``gather``); this rank's memory before and after, and the save's seconds."""
    import torch.distributed as dist
    from torch import nn

    import conveyor
    from conveyor.integrations._hf_model import gather_state_dict

    share = sum(p.numel() * p.element_size() for p in pipe.parameters())
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    dist.barrier()
    rss, peak = status_kib("VmRSS"), status_kib("VmHWM")
    start = time.perf_counter()
    if run == "save":
        conveyor.save_pretrained(pipe, where, max_shard_size=SHARD)
    else:
        # An empty module stands for the model: its own entries (those no stage holds) are
        # read from it, and here the other ranks' stages are on the meta device.
        whole = gather_state_dict(pipe, nn.Module())
        if ctx.rank == 0:
            model.save_pretrained(where, state_dict=whole, max_shard_size=SHARD)
        del whole
    seconds = time.perf_counter() - start
    after, rss_after = status_kib("VmHWM"), status_kib("VmRSS")
    dist.barrier()
    return {
        "rank": ctx.rank, "rss_before": rss * 1024, "peak_before": peak * 1024,
        "peak": after * 1024, "rss_after": rss_after * 1024, "save_seconds": seconds,
        "params": share, "share": share, "largest": largest,
        "file": status_kib("RssFile") * 1024,
    }  # fmt: skip


def save(shape: dict[str, int], where: str) -> None:
    """Build the ``whole`` model and save it as a sharded transformers checkpoint."""
    model = build_whole(shape)
    model.save_pretrained(where, max_shard_size=SHARD)
    del model


def model_bytes(shape: dict[str, int]) -> tuple[int, int]:
    """(parameters, fp32 bytes) of the model, counted on the meta device."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config(shape))
    count = sum(p.numel() for p in model.parameters())
    return count, 4 * count


def available() -> int:
    """Bytes the system can still give (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def fits(run: str, pp: int, whole: int, imports: int, runs: int = 1) -> tuple[bool, int]:
    """Whether ``pp`` ranks of ``run`` fit in the memory available now (shared by ``runs``
    alike at once), and their estimated total: every rank's imports and two copies of its
    share (parameters, gradients), the whole model on every rank for ``whole``, and an
    eighth of the model for activations and the rest; for the saves, one copy of the share
    (no gradients), and for ``gather`` three copies of the model on rank 0 (the gathered
    state dict, the pickled parts in flight, their tensors)."""
    copies = 1 if run in SAVES else 2
    per_rank = imports + copies * whole // pp + (whole if run == "whole" else 0) + whole // 8
    total = pp * per_rank + (3 * whole if run == "gather" else 0)
    return total * runs < 0.9 * available(), total


class Launch:
    """``run`` on ``pp`` fresh processes (``conveyor launch``), started at once."""

    def __init__(self, run: str, pp: int, shape: dict[str, int], weights: str | None) -> None:
        self.run, self.pp = run, pp
        self.out = tempfile.TemporaryDirectory()
        cmd = [sys.executable, "-m", "conveyor.launch", "--nproc-per-node", str(pp), __file__,
               "--worker", run, "--out", self.out.name, "--shape", json.dumps(shape),
               "--weights", weights or ""]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def reports(self) -> list[dict[str, Any]]:
        """Each rank's report, by rank, once they finish.

        Raises:
            RuntimeError: a rank failed (with the launcher's output).
        """
        output, _ = self.proc.communicate()
        with self.out:
            if self.proc.returncode:
                raise RuntimeError(f"{self.run} at pp={self.pp} failed:\n{output}")
            found = [json.loads(f.read_text()) for f in Path(self.out.name).glob("*.json")]
        return sorted(found, key=lambda r: r["rank"])


def _mib(ranks: list[dict[str, Any]], value: Any) -> str:
    """``value(rank)`` of every rank, in MiB, ``/``-joined."""
    return " / ".join(f"{value(r) / MIB:.0f}" for r in ranks)


def _markdown(runs: list[dict[str, Any]], saves: bool, header: str, row: Any) -> str:
    """A markdown table of the save runs (``saves``) or the others: ``header``'s columns,
    ``row(run, ranks)`` for each run that ran, a "skipped" row for each that did not."""
    columns = header.count("|") - 1
    lines = [header, "|---|---:|" + "---|" * (columns - 2)]
    for run in runs:
        if (run["path"] in SAVES) != saves:
            continue
        ranks = run["ranks"]
        if not ranks:
            blank = "| " * (columns - 3)
            lines.append(f"| {run['path']} | {run['pp']} | skipped: {run['skipped']} {blank}|")
            continue
        lines.append(row(run, ranks))
    return "\n".join(lines)


def table(runs: list[dict[str, Any]], whole: int) -> str:
    """The markdown table of every run (the saves': :func:`save_table`)."""

    def row(run: dict[str, Any], ranks: list[dict[str, Any]]) -> str:
        top = max(r["peak"] for r in ranks)
        return (
            f"| {run['path']} | {run['pp']} | {_mib(ranks, lambda r: r['peak'])} "
            f"| {_mib(ranks, lambda r: r['built'])} | {_mib(ranks, lambda r: r['share'])} "
            f"| {top / MIB:.0f} | {top / whole:.2f} "
            f"| {max(r['seconds'] for r in ranks):.1f} "
            f"({max(r['built_seconds'] for r in ranks):.1f}) | {ranks[0]['loss']:.4f} |"
        )

    header = (
        "| path | pp | peak per rank MiB | of it, built | share per rank MiB | max peak MiB "
        "| max / model | time to first step s (built) | loss |"
    )
    return _markdown(runs, False, header, row)


def save_table(runs: list[dict[str, Any]], whole: int) -> str:
    """The markdown table of the save runs: per rank, what it held before the save, its
    peak before and after, how far the peak rose above what it held, and its share."""

    def row(run: dict[str, Any], ranks: list[dict[str, Any]]) -> str:
        rise = max(r["peak"] - r["rss_before"] for r in ranks)
        return (
            f"| {run['path']} | {run['pp']} | {_mib(ranks, lambda r: r['rss_before'])} "
            f"| {_mib(ranks, lambda r: r['peak_before'])} | {_mib(ranks, lambda r: r['peak'])} "
            f"| {_mib(ranks, lambda r: r['peak'] - r['rss_before'])} "
            f"| {_mib(ranks, lambda r: r['share'])} | {rise / whole:.2f} "
            f"| {max(r['save_seconds'] for r in ranks):.1f} |"
        )

    header = (
        "| path | pp | held before (RSS) MiB | peak before MiB | peak after MiB "
        "| peak after - held before MiB | share MiB | max rise / model | save s |"
    )
    return _markdown(runs, True, header, row)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", default="2,4", help="pipeline sizes, comma-separated (default 2,4)")
    p.add_argument("--paths", default=",".join(PATHS), help="of whole,init,load (default all)")
    p.add_argument("--layers", type=int, help=f"decoder layers (default {FULL['layers']})")
    p.add_argument("--hidden", type=int, help=f"hidden size (default {FULL['hidden']}; the "
                   "intermediate size scales with it)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a tiny model (for a test)")
    p.add_argument("--together", action="store_true", help="start the paths of one pp at "
                   "once (faster; their times then mean nothing)")  # fmt: skip
    p.add_argument("--json", help="write every number to this file")
    p.add_argument("--keep", help="keep the directories the save paths write under this "
                   "directory (DIR/save-pp2, DIR/gather-pp2, ...)")  # fmt: skip
    p.add_argument("--worker", dest="run", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        worker(args)
        return 0
    shape = dict(QUICK if args.quick else FULL)
    if args.layers:
        shape["layers"] = args.layers
    if args.hidden:
        shape["intermediate"] = shape["intermediate"] * args.hidden // shape["hidden"]
        shape["hidden"] = args.hidden
    paths = [x for x in args.paths.split(",") if x]
    if unknown := set(paths) - set(PATHS):
        p.error(f"--paths: unknown {sorted(unknown)}; choose from {','.join(PATHS)}")
    pps = [int(x) for x in args.pp.split(",") if x]
    count, whole = model_bytes(shape)
    print(f"Llama: hidden {shape['hidden']}, {shape['layers']} layers, intermediate "
          f"{shape['intermediate']}, vocabulary {shape['vocab']}: {count / 1e6:.0f}M "
          f"parameters, {whole / MIB:.0f} MiB in fp32", flush=True)  # fmt: skip
    result: dict[str, Any] = {"model": {**shape, "parameters": count, "bytes": whole},
                              "command": " ".join(["python", *sys.argv]), "runs": []}  # fmt: skip
    imports = 600 * MIB  # until a run has measured it
    with tempfile.TemporaryDirectory(dir=os.environ.get("BIG_MODEL_DIR")) as tmp:
        weights = None
        if "load" in paths:
            weights = str(Path(tmp, "llama"))
            start = time.perf_counter()
            save(shape, weights)
            files = sorted(Path(weights).glob("*.safetensors"))
            result["save"] = {"seconds": time.perf_counter() - start, "files": len(files),
                              "bytes": sum(f.stat().st_size for f in files)}  # fmt: skip
            print(
                f"saved with save_pretrained(max_shard_size={SHARD!r}): {len(files)} files, "
                f"{result['save']['bytes'] / MIB:.0f} MiB, "
                f"{result['save']['seconds']:.1f} s (not in any run's time)",
                flush=True,
            )
        for pp in pps:
            runs = [{"path": path, "pp": pp, "ranks": []} for path in paths]
            started: list[tuple[dict[str, Any], Launch]] = []
            for run in runs:
                ok, need = fits(run["path"], pp, whole, imports, len(paths) if args.together
                                else 1)  # fmt: skip
                if not ok:
                    run["skipped"] = (f"needs about {need / 2**30:.1f} GiB, "
                                      f"{available() / 2**30:.1f} GiB available")  # fmt: skip
                    continue
                where = weights
                if run["path"] in SAVES:
                    where = str(Path(args.keep or tmp, f"{run['path']}-pp{pp}"))
                started.append((run, Launch(run["path"], pp, shape, where)))
                if not args.together:
                    run["ranks"] = started.pop()[1].reports()
                    imports = max(r["imports"] for r in run["ranks"])
                    show = save_table if run["path"] in SAVES else table
                    print(show([run], whole).splitlines()[-1], flush=True)
            for run, launched in started:
                run["ranks"] = launched.reports()
            result["runs"] += runs
    measured = [r for run in result["runs"] for r in run["ranks"]]
    steps = [run for run in result["runs"] if run["path"] not in SAVES]
    low = min((r["imports"] for r in measured), default=0) / MIB
    high = max((r["imports"] for r in measured), default=0) / MIB
    if steps:
        print(
            f"\n{count / 1e6:.0f}M-parameter Llama ({whole / MIB:.0f} MiB fp32), batch "
            f"{shape['batch']} x {shape['tokens']} tokens in {shape['microbatches']} "
            f"micro-batches, 1F1B, gloo, one thread per process. Peak: VmHWM at the end of the "
            f"first step; of it, built: VmHWM once Pipeline(..., sample=) has split the model "
            f"and given the rank's stages their values; share: parameters + gradients of the "
            f"rank's own stages; time: from the process's start (imports included) to the end "
            f"of its first step (to the built pipeline), largest rank. Each process holds "
            f"{low:.0f}-{high:.0f} MiB before building anything (interpreter, torch, "
            f"transformers, process group).\n"
        )
        print(table(steps, whole))
    if any(run["path"] in SAVES for run in result["runs"]):
        largest = max((r["largest"] for run in result["runs"] for r in run["ranks"]
                       if "largest" in r), default=0)  # fmt: skip
        print(
            f"\nSaving it as a transformers checkpoint (max_shard_size={SHARD!r}), built as "
            f"init, no step: save = conveyor.save_pretrained on every rank; gather = the whole "
            f"state dict gathered into rank 0, which writes it with model.save_pretrained. "
            f"Held before: VmRSS just before the save; peak before / after: VmHWM; the "
            f"largest tensor is {largest / MIB:.0f} MiB; save s: the slowest rank.\n"
        )
        print(save_table(result["runs"], whole))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
