"""``conveyor.save_pretrained`` on real processes: what every layout writes is read back by
transformers' ``from_pretrained`` (and by ``weights=``) bit for bit equal to the trained
pipeline's weights, a tied weight written once, experts in the published layout; a save
that dies halfway leaves the previous checkpoint readable.

Layouts (4 processes, gloo, one step trained before saving): pp=2 x dp=2 with tied
embeddings, pp=4 interleaved, pp=2 x dp=2 FSDP, pp=2 x tp=2, vocabulary parallel, a
Mixtral with ep=2, and a model built on meta loaded from ``weights=`` under FSDP."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.context import forget
from tests.support import distributed, nccl_model
from tests.support import tp_models as M
from tests.support.captures import captured
from tests.support.nccl_record import recording
from tests.support.tp_models import LR, batches, tiny

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SHARD = "24KB"  # several files per rank

LAYOUTS: dict[str, dict[str, Any]] = {
    "pp2-tied": {"kind": "llama-tied", "init": {"pp": 2, "dp": 2}, "pipe": {}},
    "pp4-interleaved": {
        "kind": "llama-tied", "init": {"pp": 4},
        "pipe": {"schedule": "interleaved-1f1b", "chunks": 2},
    },
    "pp2xdp2-fsdp": {"kind": "llama", "init": {"pp": 2, "dp": 2},
                     "pipe": {"fsdp": True, "schedule": "zb-h1"}},
    "pp2xtp2": {"kind": "llama", "init": {"pp": 2, "tp": 2}, "pipe": {"tp_plan": "auto"}},
    "vocab": {"kind": "llama-tied", "init": {"pp": 2, "dp": 2}, "pipe": {"vocab_parallel": True}},
    "mixtral-ep2": {"kind": "mixtral", "init": {"pp": 2, "dp": 2, "ep": 2}, "pipe": {}},
    "meta-weights-fsdp": {"kind": "llama", "init": {"pp": 2, "dp": 2},
                          "pipe": {"fsdp": True}, "meta": True},
}  # fmt: skip


def model_of(kind: str) -> torch.nn.Module:
    """The tiny transformers model of ``kind`` (``llama-tied``: its embedding tied to the
    output layer)."""
    if kind != "llama-tied":
        return tiny(kind)
    import transformers as T

    config = tiny("llama").config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config).float().train()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def _captured_models() -> dict[str, torch.nn.Module]:
    """Each layout's model built and captured here, as its ranks' Pipeline captures it, on
    the first micro-batch of replica 0's rows (tests/support/captures.py: the forked ranks
    split that graph instead of each exporting it again). Not the meta one (built on meta)
    nor vocab (its ranks capture it without the vocabulary layers)."""
    models = {}
    for name, layout in LAYOUTS.items():
        if layout.get("meta") or layout["pipe"].get("vocab_parallel"):
            continue
        model = model_of(layout["kind"])
        if layout["pipe"].get("tp_plan"):
            models[name] = M.captured(model, layout["pipe"]["tp_plan"], layout["init"]["tp"])
        else:
            dp = layout["init"].get("dp", 1)
            batch = {k: v[::dp] for k, v in batches()[0].items()}
            models[name] = captured(model, batch, 2)
    return models


def _layouts(
    rank: int, root: str, names: list[str], models: dict[str, torch.nn.Module]
) -> dict[str, Any]:
    """Each layout on this rank: build, train one step, save_pretrained; this rank's
    trained values (whole tensors) by name, and what the save posted (``name/posted``)."""
    out = {}
    for name in names:
        layout = LAYOUTS[name]
        forget()
        ctx = conveyor.init(**layout["init"], timeout=120)
        if layout.get("meta"):
            with conveyor.empty_weights():
                model = model_of(layout["kind"])
            options = {"weights": str(Path(root) / "source"), **layout["pipe"]}
        else:
            model = models[name] if name in models else model_of(layout["kind"])
            options = layout["pipe"]
        batch = {k: v[ctx.dp_rank :: ctx.dp_size] for k, v in batches()[0].items()}
        pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, sample=(batch, None),
                                 **options)  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        pipe.train_step(batch, None)
        opt.step()
        with recording() as posted:
            conveyor.save_pretrained(pipe, Path(root) / name, max_shard_size=SHARD)
        out[f"{name}/posted"] = posted
        out[name] = {n: _whole(v).detach().clone() for n, v in pipe.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("pretrained")
    model_of("llama").save_pretrained(root / "source")  # what the meta layout loads
    results = distributed.run(
        _layouts, 4, str(root), list(LAYOUTS), _captured_models(), timeout=600, fork=True
    )
    return root, results


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_from_pretrained_reads_every_layout_bit_for_bit(
    saved: tuple[Path, list[dict[str, Any]]], name: str
) -> None:
    import transformers as T

    root, results = saved
    where = root / name
    trained: dict[str, torch.Tensor] = {}
    for r in results:
        for n, v in r[name].items():
            assert n not in trained or torch.equal(trained[n], v), f"{n}: replicas differ"
            trained[n] = v
    back = T.AutoModelForCausalLM.from_pretrained(where)
    state = back.state_dict()
    assert set(trained) <= set(state)
    for n, v in trained.items():
        assert torch.equal(state[n], v), f"{name}: {n} differs after from_pretrained"
    # The model's trained values, not its initial ones.
    assert not torch.equal(state["model.norm.weight"], model_of("llama").model.norm.weight)

    index = json.loads((where / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {p.name for p in where.glob("*.safetensors")}, "no file outside the index"
    assert len(files) > 2, "several shards"
    assert not list(where.glob("*.tmp"))
    assert json.loads((where / "config.json").read_text())["architectures"]
    if "tied" in LAYOUTS[name]["kind"]:
        assert "lm_head.weight" not in index["weight_map"], "a tied weight is written once"
    if name == "mixtral-ep2":  # the published layout: one 2-D tensor per expert
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in index["weight_map"]
        assert not any("gate_up_proj" in k for k in index["weight_map"])

    # conveyor's own reader (weights=) reads it too.
    with conveyor.empty_weights():
        again = model_of(LAYOUTS[name]["kind"])
    conveyor.materialize(again, weights=where)
    for n, v in again.state_dict().items():
        assert torch.equal(v, state[n]), f"{name}: {n} differs through weights="


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_save_posts_what_nccl_runs(saved: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    """Every rank's collectives (the object collectives, each sharded tensor made whole
    among its holders) replayed under NCCL's rules: same order in every group."""
    _, results = saved
    nccl_model.check({r: result[f"{name}/posted"] for r, result in enumerate(results)})


def _killed(rank: int, root: str) -> None:
    """Save twice; the second time rank 1 dies writing its second file."""
    from conveyor.weights import safetensors_file

    conveyor.init(pp=2, timeout=20)
    model = model_of("llama")
    batch = batches()[0]
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, sample=(batch, None))
    conveyor.save_pretrained(pipe, root, max_shard_size=SHARD)
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    if rank == 1:
        save = safetensors_file.save_file
        count = [0]

        def dying(tensors: dict[str, torch.Tensor], path: Any, metadata: Any = None) -> None:
            count[0] += 1
            if count[0] == 2:  # dies in its second file, half of it written
                Path(path).write_bytes(b"cut short")
                os._exit(3)
            save(tensors, path, metadata=metadata)

        safetensors_file.save_file = dying
    conveyor.save_pretrained(pipe, root, max_shard_size=SHARD)


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    import transformers as T

    where = tmp_path / "ckpt"
    got = distributed.run(_killed, 2, str(where), timeout=120, allow_errors=True, expect=[0],
                          fork=True)  # fmt: skip
    assert "rank" in str(got[0]), got  # rank 0 was told its peer is gone
    before = model_of("llama").state_dict()
    back = T.AutoModelForCausalLM.from_pretrained(where).state_dict()
    for n, v in back.items():
        assert torch.equal(v, before[n]), f"{n}: not the previous checkpoint's"
    index = json.loads((where / "model.safetensors.index.json").read_text())
    assert all((where / f).is_file() for f in index["weight_map"].values())
