"""Safetensors files through the ``safetensors`` package: what a read gives (the stored
values, a box of them, in memory of its own), what a write leaves (transformers' header
metadata, the mode of a file created here, nothing under a temporary name), the atomic
commit every checkpoint writer ends with (the file, then the rename, then its directory
flushed), and where a shard file ends (at ``max_shard_size`` exactly, as transformers and
huggingface_hub cut them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conveyor import storage
from conveyor.errors import CheckpointError
from conveyor.weights import safetensors_file
from conveyor.weights.safetensors_file import File, pack, write_file


def _stored(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(7, 5, generator=g),
        "b": torch.randn(5, generator=g).bfloat16(),
        "ids": torch.arange(6).view(2, 3),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("chunk", [16 * 2**20, 40], ids=["one-run", "runs-of-2-rows"])
def test_a_read_gives_the_stored_tensor_or_its_box_in_memory_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(safetensors_file, "CHUNK", chunk)  # rows of "w": 20 bytes
    path, want = _stored(tmp_path)
    f = File(path)
    assert {n: (i.dtype, i.shape) for n, i in f.entries.items()} == {
        n: (v.dtype, tuple(v.shape)) for n, v in want.items()
    }
    for name, value in want.items():
        got = f.read(name)
        assert got.dtype == value.dtype and torch.equal(got, value)
        assert got.untyped_storage().nbytes() == got.nbytes  # not a view of the file
    # Boxes: rows (an FSDP or vocabulary shard), columns (a row-wise TP shard), both.
    for part in [(slice(2, 5), slice(0, 5)), (slice(0, 7), slice(1, 3)),
                 (slice(6, 7), slice(4, 5)), (slice(3, 3), slice(0, 5))]:  # fmt: skip
        got = f.read("w", part)
        assert torch.equal(got, want["w"][part]) and got.is_contiguous()
        assert got.untyped_storage().nbytes() == got.nbytes
    # The file replaced afterwards (as a later save does): the values read stay.
    kept = f.read("w", (slice(1, 4), slice(0, 5)))
    save_file({k: torch.zeros_like(v) for k, v in want.items()}, path)
    assert torch.equal(kept, want["w"][1:4])


def test_what_cannot_be_read_is_a_checkpoint_error_naming_the_file(tmp_path: Path) -> None:
    path, _ = _stored(tmp_path)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors.*is it damaged\?"):
        File(cut)
    odd = tmp_path / "odd.safetensors"
    save_file({"c": torch.zeros(2, dtype=torch.complex64)}, odd)
    with pytest.raises(CheckpointError, match=r"stores c as C64, which conveyor cannot read"):
        File(odd)


def test_a_written_file_is_what_transformers_writes_and_readable_by_others(
    tmp_path: Path,
) -> None:
    _, tensors = _stored(tmp_path)
    experts = torch.randn(3, 4, 2)
    tensors.update({f"e{i}": experts[i] for i in range(3)})  # views of one tensor
    target = tmp_path / "out.safetensors"
    write_file(target, tensors)
    back = load_file(target)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], v) for n, v in tensors.items())
    with safe_open(target, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers' save_pretrained writes
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "x.safetensors"]


def record_commits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fsync (of which path) and rename (to which path), in order."""
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src: Any, dst: Any) -> None:
        events.append(("rename", f"{os.path.realpath(src)} -> {os.path.realpath(dst)}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


def assert_committed(events: list[tuple[str, str]], final: Path) -> None:
    """``final`` was committed as :func:`conveyor.storage.commit` does: its content flushed
    under the temporary name, renamed, then its directory flushed."""
    final = Path(os.path.realpath(final))
    renames = [i for i, (kind, what) in enumerate(events)
               if kind == "rename" and what.endswith(f" -> {final}")]  # fmt: skip
    assert len(renames) == 1, f"{final} renamed {len(renames)} times: {events}"
    at = renames[0]
    partial = events[at][1].split(" -> ")[0]
    assert ("fsync", partial) in events[:at], f"{partial} not flushed before its rename"
    assert ("fsync", str(final.parent)) in events[at + 1 :], f"{final.parent} not flushed"


def test_the_commit_flushes_the_file_then_renames_then_flushes_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = record_commits(monkeypatch)
    write_file(tmp_path / "a.safetensors", {"x": torch.ones(3)})
    assert_committed(events, tmp_path / "a.safetensors")
    events.clear()
    storage.write_text(tmp_path / "index.json", "{}")
    assert_committed(events, tmp_path / "index.json")
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["a.safetensors", "index.json"]


def test_a_shard_ends_at_max_shard_size_exactly_as_huggingface_hub_cuts() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    # sizes in bytes (float32 tensors of n / 4 elements), the limit 40 bytes
    cases = [[20, 20, 4], [40, 4], [16, 24, 8, 32], [36, 8, 32, 4, 4]]
    for sizes in cases:
        names = [f"t{i}" for i in range(len(sizes))]
        ours = pack(list(zip(names, sizes, strict=True)), 40)
        state = {n: torch.zeros(s // 4) for n, s in zip(names, sizes, strict=True)}
        split = split_torch_state_dict_into_shards(state, max_shard_size=40)
        theirs = sorted(split.filename_to_tensors.values(), key=lambda g: names.index(g[0]))
        assert ours == [sorted(g, key=names.index) for g in theirs], sizes
    # a file exactly at the limit is one file; a tensor exactly at it fills one alone
    assert pack([("a", 20), ("b", 20)], 40) == [["a", "b"]]
    assert pack([("a", 40), ("b", 1)], 40) == [["a"], ["b"]]
