"""``conveyor convert``: a conveyor checkpoint into a transformers directory and back, bit
for bit, tensor by tensor (peak memory measured), replacing an older checkpoint only once
the new one is whole, and refusing what it must not overwrite.

Round trips: a plain module with a tied weight in one process (fast); a transformers Llama
saved by a pp=2 pipeline on real processes, and a Mixtral whose experts transformers
stores in another layout than it holds them (slow lane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import conveyor
from conveyor.checkpoint.convert import convert
from conveyor.checkpoint.published import CONFIGS
from conveyor.cli.command import main
from conveyor.errors import CheckpointError, ConfigError
from conveyor.weights.safetensors_file import CHUNK
from tests.support import distributed

ROOT = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"
SHARD_1 = "model-00001-of-00001.safetensors"  # one file: a shard and the index


def _module() -> nn.Module:
    """Embedding, two linears and a norm; the head tied to the embedding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 10, bias=False))  # fmt: skip
    model[3].weight = model[0].weight
    model.register_buffer("scale", torch.randn(3).bfloat16())  # other dtypes too
    model.register_buffer("seen", torch.tensor([7, 11]))
    with torch.no_grad():  # values no initialization draws
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers directory, from its files."""
    if (path / INDEX).is_file():
        files = set(json.loads((path / INDEX).read_text())["weight_map"].values())
    else:
        files = {"model.safetensors"}
    out: dict[str, torch.Tensor] = {}
    for f in sorted(files):
        out.update(load_file(str(path / f)))
    return out


def _quiet_convert(*args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(*args, **kwargs)


# ---------------------------------------------------------------- a plain module, fast
def test_a_module_round_trip_sharded_with_the_tie_written_once(tmp_path: Path) -> None:
    model = _module()
    conveyor.save(model, tmp_path / "ckpt")
    with pytest.warns(UserWarning, match="no config.json was written"):
        done = convert(tmp_path / "ckpt", tmp_path / "hf", to="transformers", max_shard_size=300)
    hf = tmp_path / "hf"
    index = json.loads((hf / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    assert sorted(p.name for p in hf.iterdir()) == sorted([*shards, INDEX])
    got = _hf_tensors(hf)
    want = model.state_dict()
    assert sorted(got) == sorted(k for k in want if k != "3.weight")  # the tie: once
    assert all(torch.equal(v, want[k]) for k, v in got.items())
    assert done.tensors == 7 and done.note and "--config" in done.note
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in got.values())

    back = convert(hf, tmp_path / "back", to="conveyor")
    state = conveyor.load_model_state(tmp_path / "back")
    assert list(state) == list(got) and all(torch.equal(state[k], got[k]) for k in got)
    assert state["scale"].dtype == torch.bfloat16 and state["seen"].dtype == torch.int64
    assert back.to == "conveyor" and (tmp_path / "back" / "latest").is_file()
    # One .safetensors file converts too.
    one = tmp_path / "one.safetensors"
    (hf / shards[0]).rename(one)
    assert convert(one, tmp_path / "single", to="conveyor").tensors == len(load_file(str(one)))


class _Counter(nn.Linear):
    """A linear layer with extra state (not a tensor)."""

    def get_extra_state(self) -> Any:
        return {"calls": 3}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def test_what_safetensors_cannot_hold_is_named(tmp_path: Path) -> None:
    conveyor.save(nn.Sequential(_Counter(2, 2)), tmp_path / "ckpt")
    with pytest.warns(UserWarning, match=r"1 entries .* not tensors .*e\.g\. 0\._extra_state"):
        done = convert(tmp_path / "ckpt", tmp_path / "hf", to="transformers")
    assert sorted(_hf_tensors(tmp_path / "hf")) == ["0.bias", "0.weight"]
    assert done.note and done.note.startswith("no config.json was written")


def test_the_command_line_writes_and_says_no_config_was_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conveyor.save(_module(), tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "ckpt"), str(out), "--to", "transformers"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("wrote 7 tensors") and str(out) in captured.out
    assert captured.err.count("\n") == 1 and "no config.json was written" in captured.err
    assert sorted(p.name for p in out.iterdir()) == [SHARD_1, INDEX]
    assert main(["convert", str(out), str(tmp_path / "back"), "--to", "conveyor"]) == 0
    assert "as a conveyor checkpoint" in capsys.readouterr().out


def test_bad_input_is_refused_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conveyor.save(_module(), tmp_path / "ckpt")
    _quiet_convert(tmp_path / "ckpt", tmp_path / "hf", to="transformers")
    cases = [
        (tmp_path / "missing", tmp_path / "o1", "transformers", "does not exist"),
        (tmp_path / "hf", tmp_path / "o2", "transformers", "use --to conveyor"),
        (tmp_path / "ckpt", tmp_path / "o3", "conveyor", "use --to transformers"),
        (tmp_path / "ckpt", tmp_path / "ckpt", "transformers", "into itself"),
    ]
    for src, out, to, says in cases:
        with pytest.raises(CheckpointError, match=says):
            convert(src, out, to=to)
        assert main(["convert", str(src), str(out), "--to", to]) == 2
        err = capsys.readouterr().err
        assert err.startswith("conveyor convert: error: ") and err.count("\n") == 1
        assert says in err
    with pytest.raises(ConfigError, match="to must be 'transformers' or 'conveyor'"):
        convert(tmp_path / "ckpt", tmp_path / "o4", to="safetensors")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "o4"), "--to", "hf"]) == 2
    assert "invalid choice: 'hf'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        convert(tmp_path / "ckpt", tmp_path / "o5", to="transformers", config=tmp_path)
    with pytest.raises(ConfigError, match="max_shard_size"):
        convert(tmp_path / "ckpt", tmp_path / "o6", to="transformers", max_shard_size="lots")
    # An output directory that holds something else is never written into.
    for to, src in (("transformers", "ckpt"), ("conveyor", "hf")):
        other = tmp_path / f"other-{to}"
        other.mkdir()
        (other / "notes.txt").write_text("mine")
        with pytest.raises(CheckpointError, match=f"holds no {to} checkpoint, so it is not"):
            convert(tmp_path / src, other, to=to)
        assert [p.name for p in other.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="it is a file"):
        convert(tmp_path / "ckpt", tmp_path / "file", to="transformers")
    assert not list(tmp_path.glob(".*.tmp")) and not list(tmp_path.glob("o[0-9]"))


def test_an_existing_checkpoint_is_replaced_and_kept_whole_until_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _module()
    conveyor.save(model, tmp_path / "ckpt")
    hf = tmp_path / "hf"
    _quiet_convert(tmp_path / "ckpt", hf, to="transformers", max_shard_size=300)
    (hf / "tokenizer.json").write_text("{}")  # not the checkpoint's: kept
    first = _hf_tensors(hf)
    # One file now; the other shards are gone (the index lists its shard).
    _quiet_convert(tmp_path / "ckpt", hf, to="transformers")
    assert sorted(p.name for p in hf.iterdir()) == [SHARD_1, INDEX, "tokenizer.json"]
    assert _hf_tensors(hf).keys() == first.keys()
    # A model.safetensors of transformers' own there is replaced too; then shards over
    # shards of the same names: new names, so that the old files stay whole until the
    # index moves.
    os.replace(hf / SHARD_1, hf / "model.safetensors")
    (hf / INDEX).unlink()
    _quiet_convert(tmp_path / "ckpt", hf, to="transformers", max_shard_size=300)
    assert not (hf / "model.safetensors").exists()
    _quiet_convert(tmp_path / "ckpt", hf, to="transformers", max_shard_size=300)
    names = sorted(p.name for p in hf.iterdir())
    weight_map = json.loads((hf / INDEX).read_text())["weight_map"]
    assert names == sorted({*weight_map.values(), INDEX, "tokenizer.json"})
    assert all(torch.equal(v, first[k]) for k, v in _hf_tensors(hf).items())

    # A conversion that fails halfway leaves the previous checkpoint as it was.
    from conveyor.weights import safetensors_file

    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    calls = []
    save = safetensors_file.save_file

    def failing(tensors: dict[str, torch.Tensor], path: Any, metadata: Any = None) -> None:
        calls.append(path)
        if len(calls) == 1:  # half of the file written
            Path(path).write_bytes(b"cut short")
            raise OSError(28, "No space left on device")
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors_file, "save_file", failing)
    with pytest.raises(CheckpointError, match=r"writing .*model-.*safetensors failed: .*No space"):
        _quiet_convert(tmp_path / "ckpt", hf, to="transformers")
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    assert not list(tmp_path.glob(".*.tmp"))
    monkeypatch.undo()
    # ... and so does one that fails at its commit, replacing the index.
    replace = os.replace

    def failing_index(src: Any, dst: Any) -> None:
        if Path(dst) == hf / INDEX:
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_index)
    with pytest.raises(CheckpointError, match=r"writing .*index\.json failed: .* is kept"):
        _quiet_convert(tmp_path / "ckpt", hf, to="transformers", max_shard_size=300)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before

    # A conveyor checkpoint replaces the one in OUT like conveyor.save does.
    _quiet_convert(hf, tmp_path / "back", to="conveyor")
    old = (tmp_path / "back" / "latest").read_text().strip()
    _quiet_convert(hf, tmp_path / "back", to="conveyor")
    new = (tmp_path / "back" / "latest").read_text().strip()
    assert new != old and sorted(p.name for p in (tmp_path / "back").iterdir()) == ["latest", new]
    state = conveyor.load_model_state(tmp_path / "back")
    assert all(torch.equal(state[k], first[k]) for k in first)
    # ... and keeps it when reading fails halfway; a new OUT is not even created.
    reads = []

    def failing_read(self: Any, names: Any) -> Any:
        reads.append(names)
        if len(reads) == 3:
            raise OSError(5, "Input/output error")
        return read(self, names)

    from conveyor.weights.sources import Safetensors

    read = Safetensors.read
    monkeypatch.setattr(Safetensors, "read", failing_read)
    for out in (tmp_path / "back", tmp_path / "new"):
        reads.clear()
        with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[0\]: OSError"):
            _quiet_convert(hf, out, to="conveyor")
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["latest", new]
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------- peak memory, slow
PEAK = """
import json, sys
import torch
from conveyor.checkpoint.convert import convert

def status():
    found = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found

src, out, to, buffer = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (imports) is forgotten: VmHWM = VmRSS now
before = status()["VmRSS"]
convert(src, out, to=to, buffer=buffer, max_shard_size="64MB")
print(json.dumps({"growth": status()["VmHWM"] - before}))
"""
MAKE = """
import sys, torch, conveyor
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.ParameterList([nn.Parameter(torch.randn(2**19)) for _ in range(160)])
        self.big = nn.Parameter(torch.randn(12 * 2**20))

conveyor.save(Model(), sys.argv[1])
"""
BIG = 12 * 2**20 * 4  # bytes of the largest tensor: 48 MiB; the checkpoint holds 368 MiB


def _python(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_peak_memory_is_one_file_or_one_tensor_not_the_checkpoint(tmp_path: Path) -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset this system's peak memory count (VmHWM): {exc}")
    _python(MAKE, str(tmp_path / "ckpt"))
    size = sum(p.stat().st_size for p in (tmp_path / "ckpt").rglob("*.distcp"))
    buffer = 8 * 2**20
    margin = 32 * 2**20
    bounds = {
        # the shard file being filled (64 MB, which the package writes at once) and a
        # buffer of reads
        "transformers": 64 * 10**6 + buffer + margin,
        # one tensor, and a run of the file mapped while it is copied out
        "conveyor": BIG + CHUNK + margin,
    }
    assert size > 2 * max(bounds.values())
    for src, out, to in (("ckpt", "hf", "transformers"), ("hf", "back", "conveyor")):
        growth = json.loads(_python(PEAK, str(tmp_path / src), str(tmp_path / out), to,
                                    str(buffer)))["growth"]  # fmt: skip
        assert growth < bounds[to], f"--to {to}: grew by {growth / 2**20:.0f} MiB"
    state = conveyor.load_model_state(tmp_path / "back")
    want = conveyor.load_model_state(tmp_path / "ckpt")
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)


# --------------------------------------------------- transformers models, slow lane
SEED = 5


def _llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=32, use_cache=False,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def _llama() -> nn.Module:
    import transformers

    with conveyor.empty_weights():
        return transformers.LlamaForCausalLM(_llama_config())


def _save_pp2(rank: int, path: str) -> dict[str, torch.Tensor]:
    """A pp=2 pipeline of the meta-built Llama (weights from the seed) saved at ``path``;
    this rank's values."""
    ids = torch.randint(1, 97, (4, 8), generator=torch.Generator().manual_seed(1))
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(_llama(), loss_fn=None, microbatches=2, init_seed=SEED,
                             sample=({"input_ids": ids, "labels": ids}, None))  # fmt: skip
    conveyor.save(pipe, path, step=3)
    return {n: v.detach().clone() for n, v in pipe.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_pp2_checkpoint_to_transformers_and_back_bit_for_bit(tmp_path: Path) -> None:
    import transformers

    ranks = distributed.run(_save_pp2, 2, str(tmp_path / "ckpt"), fork=True)
    held = {**ranks[0], **ranks[1]}
    reference = conveyor.materialize(_llama(), init_seed=SEED)
    want = reference.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in held.items())
    config = tmp_path / "config"
    _llama_config().save_pretrained(config)

    (config / "generation_config.json").write_text('{"max_length": 20}\n')
    hf = tmp_path / "hf"
    argv = [str(tmp_path / "ckpt"), str(hf), "--to", "transformers", "--config", str(config)]
    assert main(["convert", *argv, "--max-shard-size", "20KB"]) == 0
    assert (hf / INDEX).is_file() and all((hf / n).read_bytes() == (config / n).read_bytes()
                                          for n in CONFIGS)  # fmt: skip
    assert "lm_head.weight" not in _hf_tensors(hf)  # tied: written once
    loaded = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)
    got = loaded.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight

    back = tmp_path / "back"
    convert(hf, back, to="conveyor", config=config)
    state = conveyor.load_model_state(back)
    assert list(state) == list(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
    meta = json.loads(next(back.glob("nostep-*/conveyor.json")).read_text())
    assert meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    # conveyor.load and weights= read it, into a model with real and with meta parameters
    target = conveyor.materialize(_llama(), init_seed=SEED + 1)
    conveyor.load(target, back)
    assert all(torch.equal(v, want[k]) for k, v in target.state_dict().items())
    from_weights = conveyor.materialize(_llama(), weights=back)
    assert all(torch.equal(v, want[k]) for k, v in from_weights.state_dict().items())


@pytest.mark.slow
def test_a_mixtral_in_the_layout_transformers_saves_and_back(tmp_path: Path) -> None:
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
        num_experts_per_tok=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = transformers.MixtralForCausalLM(cfg).float()
    want = model.state_dict()
    assert want["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3  # held stacked
    cfg.save_pretrained(tmp_path / "config")
    model.save_pretrained(tmp_path / "published", max_shard_size="8KB")
    conveyor.save(model, tmp_path / "ckpt")

    hf = tmp_path / "hf"
    convert(tmp_path / "ckpt", hf, to="transformers", config=tmp_path / "config",
            max_shard_size="8KB")  # fmt: skip
    published = json.loads((tmp_path / "published" / INDEX).read_text())["weight_map"]
    written = json.loads((hf / INDEX).read_text())["weight_map"]
    assert sorted(written) == sorted(published)  # one tensor per expert, transformers' names
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in written
    theirs = _hf_tensors(tmp_path / "published")
    assert all(torch.equal(v, theirs[k]) for k, v in _hf_tensors(hf).items())
    loaded = transformers.MixtralForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())

    back = tmp_path / "back"
    done = convert(tmp_path / "published", back, to="conveyor", config=tmp_path / "config")
    assert done.tensors == len(want)  # experts stacked again, as the model holds them
    state = conveyor.load_model_state(back)
    assert list(state) == list(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
    # A config.json transformers cannot read is refused before anything is written.
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"transformers cannot read its config\.json"):
        convert(tmp_path / "published", tmp_path / "o", to="conveyor", config=tmp_path / "bad")
    assert not (tmp_path / "o").exists()
