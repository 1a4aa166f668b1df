"""``conveyor.save_pretrained`` in one process: shards within ``max_shard_size``, a model
without a transformers config, directories it refuses, a write that fails (the previous
checkpoint stays), and saving twice into one directory."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from torch import nn

import conveyor
from conveyor.context import forget
from conveyor.errors import CheckpointError, ConfigError
from conveyor.weights import safetensors_file
from conveyor.weights.safetensors_file import pack, parse_size
from tests.support.models import batch, mlp


@pytest.fixture(autouse=True)
def _one_process() -> Any:
    forget()
    yield
    forget()


def _pipe(seed: int = 0) -> conveyor.Pipeline:
    conveyor.init(pp=2)
    return conveyor.Pipeline(mlp(seed=seed), loss_fn=nn.functional.mse_loss, microbatches=2)


def _read(path: Path) -> dict[str, torch.Tensor]:
    model = mlp(seed=9)
    conveyor.materialize(model, weights=path)
    return model.state_dict()


def test_a_model_without_config_gets_weights_an_index_and_a_warning(tmp_path: Path) -> None:
    pipe = _pipe()
    with pytest.warns(UserWarning, match="no config.json"):
        conveyor.save_pretrained(pipe, tmp_path, max_shard_size=400)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files and len(files) > 1
    assert not (tmp_path / "config.json").exists()
    for f in files:  # within the limit unless one tensor alone is larger
        tensors = [n for n, v in index["weight_map"].items() if v == f]
        assert (tmp_path / f).stat().st_size <= 400 + 1000 or len(tensors) == 1
    want = mlp(seed=0).state_dict()
    assert all(torch.equal(v, want[n]) for n, v in _read(tmp_path).items())
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in want.values())


def test_saving_again_replaces_the_checkpoint_and_leaves_no_old_file(tmp_path: Path) -> None:
    pipe = _pipe()
    with pytest.warns(UserWarning):
        conveyor.save_pretrained(pipe, tmp_path, max_shard_size=400)
    first = {p.name for p in tmp_path.iterdir()}
    with torch.no_grad():
        for p in pipe.parameters():
            p.mul_(2)
    with pytest.warns(UserWarning):  # the same shard count: the new files get other names
        conveyor.save_pretrained(pipe, tmp_path, max_shard_size=400)
    second = {p.name for p in tmp_path.iterdir()}
    assert first.isdisjoint(second - {"model.safetensors.index.json"})
    want = {n: v * 2 for n, v in mlp(seed=0).state_dict().items()}
    assert all(torch.equal(v, want[n]) for n, v in _read(tmp_path).items())


def test_a_failing_write_names_the_file_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = _pipe()
    with pytest.warns(UserWarning):
        conveyor.save_pretrained(pipe, tmp_path, max_shard_size=400)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1)
    save = safetensors_file.save_file
    count = [0]

    def full(tensors: dict[str, torch.Tensor], path: Any, metadata: Any = None) -> None:
        count[0] += 1
        if count[0] == 2:  # the package's own error, half a file written
            Path(path).write_bytes(b"cut short")
            raise SafetensorError("Error while serializing: No space left on device (os error 28)")
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors_file, "save_file", full)
    with pytest.raises(CheckpointError, match=r"rank 0: writing .*model-.*safetensors failed: "
                       r".*No space left on device.*; .* keeps its previous"):  # fmt: skip
        conveyor.save_pretrained(pipe, tmp_path, max_shard_size=400)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    want = mlp(seed=0).state_dict()
    assert all(torch.equal(v, want[n]) for n, v in _read(tmp_path).items())


def test_refuses_a_directory_that_is_not_a_checkpoint_and_a_file(tmp_path: Path) -> None:
    pipe = _pipe()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="non-empty directory that holds no checkpoint"):
        conveyor.save_pretrained(pipe, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    with pytest.raises(CheckpointError, match="it is a file"):
        conveyor.save_pretrained(pipe, tmp_path / "notes.txt")
    with pytest.raises(ConfigError, match="max_shard_size"):
        conveyor.save_pretrained(pipe, tmp_path / "new", max_shard_size="lots")


def test_a_plain_module_in_one_process_and_transformers_reads_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    conveyor.save_pretrained(model, tmp_path, max_shard_size="10KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: once
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    want = model.state_dict()
    assert all(torch.equal(v, want[n]) for n, v in back.state_dict().items())
    assert (tmp_path / "generation_config.json").is_file()


def test_shard_sizes_as_transformers_reads_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20
    assert parse_size(123) == 123
    for bad in ("", "-1GB", 0, "5 parsecs", 1.5):
        with pytest.raises(ValueError):
            parse_size(bad)  # type: ignore[arg-type]
    assert pack([("a", 2), ("b", 2), ("c", 9), ("d", 1)], 5) == [["a", "b"], ["c"], ["d"]]


def test_a_tied_weight_is_stored_under_the_name_transformers_keeps() -> None:
    transformers = pytest.importorskip("transformers")
    from conveyor.checkpoint.published import Published

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      tie_word_embeddings=True)  # fmt: skip
    published = Published(transformers.LlamaForCausalLM(config))
    # Whichever copy a split met first (here the output layer's), the embedding's name.
    tied = {"lm_head.weight": "lm_head.weight", "model.embed_tokens.weight": "lm_head.weight"}
    assert set(published.preferred(tied).values()) == {"model.embed_tokens.weight"}
    assert published.preferred({"mlp.w": "mlp.w"}) == {"mlp.w": "mlp.w"}


def test_a_tie_is_stored_as_transformers_stores_it_whatever_the_models_order(
    tmp_path: Path,
) -> None:
    """The declared copy (``head.weight``) comes first in the model's order here: the name
    stored is still the one transformers' own save_pretrained keeps."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from conveyor.checkpoint.published import Published

    class Tied(transformers.PreTrainedModel):  # type: ignore[misc]
        config_class = transformers.PretrainedConfig
        _tied_weights_keys = {"head.weight": "embed.weight"}  # noqa: RUF012 (transformers')

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.head = nn.Linear(4, 6, bias=False)
            self.embed = nn.Embedding(6, 4)
            self.head.weight = self.embed.weight
            self.post_init()

    model = Tied(transformers.PretrainedConfig())
    assert list(model.state_dict()) == ["head.weight", "embed.weight"]
    tied = {"head.weight": "head.weight", "embed.weight": "head.weight"}
    assert set(Published(model).preferred(tied).values()) == {"embed.weight"}
    model.save_pretrained(tmp_path / "theirs")
    with safe_open(tmp_path / "theirs" / "model.safetensors", framework="pt") as f:
        assert list(f.keys()) == ["embed.weight"]
    conveyor.save_pretrained(model, tmp_path / "ours")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == ["embed.weight"]


def test_the_training_state_beside_it_holds_no_weights(tmp_path: Path) -> None:
    from conveyor.checkpoint import load_training_state, save_training_state

    pipe = _pipe()
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    pipe.train_step(*batch(4))
    opt.step()
    save_training_state(pipe, tmp_path / "state", opt, step=3)
    stored = torch.distributed.checkpoint.FileSystemReader(
        conveyor.storage.resolve(tmp_path / "state")
    ).read_metadata()
    keys = set(stored.state_dict_metadata)
    assert keys and all(k.startswith("optim/") for k in keys)  # the weights are not stored
    for load in (conveyor.load, conveyor.load_model_state):
        with pytest.raises(CheckpointError, match="holds optimizer state only"):
            load(*((pipe, tmp_path / "state") if load is conveyor.load else (tmp_path / "state",)))
    again = torch.optim.AdamW(pipe.parameters(), lr=0.5)
    assert load_training_state(pipe, tmp_path / "state", again) == 3
    want, got = opt.state_dict(), again.state_dict()
    assert got["param_groups"][0]["lr"] == 0.1
    for i, s in want["state"].items():
        assert all(torch.equal(v, got["state"][i][k]) for k, v in s.items())


def test_every_checkpoint_writer_commits_each_file_through_the_one_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_pretrained, conveyor.save and conveyor convert (both ways): each file and
    directory they make is flushed, renamed, and its directory flushed."""
    from conveyor.checkpoint.convert import convert
    from tests.weights.test_safetensors_file import assert_committed, record_commits

    events = record_commits(monkeypatch)
    pipe = _pipe()
    with pytest.warns(UserWarning):
        conveyor.save_pretrained(pipe, tmp_path / "hf", max_shard_size=400)
    written = sorted((tmp_path / "hf").iterdir())
    assert len(written) > 3
    for path in written:
        assert_committed(events, path)

    events.clear()
    conveyor.save(pipe, tmp_path / "ckpt")
    current = conveyor.storage.resolve(tmp_path / "ckpt")
    partial = current.with_name(current.name + ".tmp")  # conveyor.json goes in first
    for path in (partial / "conveyor.json", current, tmp_path / "ckpt" / "latest"):
        assert_committed(events, path)

    for src, out, to in (("ckpt", "hf2", "transformers"), ("hf", "back", "conveyor")):
        events.clear()
        with pytest.warns(UserWarning) if to == "transformers" else contextlib.nullcontext():
            convert(tmp_path / src, tmp_path / out, to=to)
        if to == "transformers":
            for path in (tmp_path / out).iterdir():
                assert_committed(events, path)
        else:
            back = conveyor.storage.resolve(tmp_path / out)
            partial = back.with_name(back.name + ".tmp")
            for path in (partial / "conveyor.json", back, tmp_path / out / "latest"):
                assert_committed(events, path)


def test_the_keys_a_transformers_model_ignores_on_save_are_left_out_as_it_does(
    tmp_path: Path,
) -> None:
    """Marian declares its sinusoidal position tables ``_keys_to_ignore_on_save``:
    save_pretrained writes every other tensor, the same names as transformers' own
    save_pretrained, and from_pretrained reads it back whole."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    config = transformers.MarianConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
        max_position_embeddings=16, pad_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config)
    ignored = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}
    assert set(model._keys_to_ignore_on_save) == ignored
    conveyor.save_pretrained(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs")
    ours = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    with safe_open(tmp_path / "theirs" / "model.safetensors", framework="pt") as f:
        theirs = set(f.keys())
    assert set(ours["weight_map"]) == theirs
    assert not ignored & theirs and "model.shared.weight" in theirs
    back = transformers.MarianMTModel.from_pretrained(tmp_path / "ours")
    want = model.state_dict()
    assert all(torch.equal(v, want[n]) for n, v in back.state_dict().items())
