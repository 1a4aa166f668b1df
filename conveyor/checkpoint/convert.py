"""One checkpoint format into the other, tensor by tensor: a conveyor checkpoint
(:func:`conveyor.save`, any layout) into a transformers directory (safetensors files, the
index, the config), and back.

Neither direction holds the checkpoint in memory: ``to="transformers"``
(:mod:`conveyor.checkpoint.to_transformers`) holds one shard file's tensors and a bounded
buffer of reads at a time, ``to="conveyor"`` (:mod:`conveyor.checkpoint.to_conveyor`) one
tensor (with its group, for the tensors transformers converts together, such as a
layer's experts). This module is the entry point and the checks made before anything is
read or written.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from conveyor.checkpoint.hf_dir import holds_checkpoint
from conveyor.checkpoint.to_conveyor import to_conveyor
from conveyor.checkpoint.to_transformers import to_transformers
from conveyor.errors import CheckpointError, ConfigError
from conveyor.storage import LATEST, exists
from conveyor.weights.empty import empty_weights
from conveyor.weights.safetensors_file import INDEX, SINGLE, parse_size

__all__ = ["BUFFER", "TARGETS", "Conversion", "check", "convert"]

TARGETS = ("transformers", "conveyor")
"""The formats :func:`convert` writes."""
BUFFER = 64 * 2**20
"""The most bytes of tensors read at once, unless one tensor alone is larger."""


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` wrote."""

    path: Path
    """The directory written."""
    to: str
    """``"transformers"`` or ``"conveyor"``."""
    tensors: int
    """How many tensors it holds."""
    nbytes: int
    """Their total size in bytes."""
    files: list[str] = field(default_factory=list)
    """The files written in ``path`` (safetensors files, index, configs; or the checkpoint)."""
    note: str | None = None
    """A sentence about what was not written (no config), or None."""


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    to: str,
    config: str | os.PathLike[str] | None = None,
    *,
    max_shard_size: int | str = "5GB",
    buffer: int = BUFFER,
) -> Conversion:
    """Convert the checkpoint at ``src`` into format ``to`` at ``out``, tensor by tensor.

    ``to="transformers"``: ``src`` is a conveyor checkpoint (written by
    :func:`conveyor.save`, any layout); ``out`` gets safetensors shards of at most
    ``max_shard_size`` and ``model.safetensors.index.json``, as
    :func:`conveyor.save_pretrained` writes them, each tied weight once. With ``config``,
    its ``config.json`` and ``generation_config.json`` are copied too and a transformers
    model's converted tensors (mixture-of-experts experts) are written in the layout its
    own ``save_pretrained`` writes, so ``from_pretrained`` reads the directory; without
    it, a warning says that no config was written.

    ``to="conveyor"``: ``src`` is a transformers checkpoint directory (or one
    ``.safetensors`` file); ``out`` gets a conveyor checkpoint that :func:`conveyor.load`,
    ``Pipeline(weights=)`` and :func:`conveyor.load_model_state` read. With ``config``,
    under the names the transformers model has (experts stacked as it holds them, tied
    weights stored once); without it, under the stored names.

    In memory at a time: ``to="conveyor"``, one tensor (or one group transformers
    converts together); ``to="transformers"``, the tensors of the shard file being filled
    (at most ``max_shard_size``, or one larger tensor) plus ``buffer`` bytes of reads.
    ``out`` may be missing, empty, or a checkpoint of format ``to`` (replaced; until the
    new one is whole, the old one stays readable).

    Args:
        src: The checkpoint to convert.
        out: The directory to write.
        to: ``"transformers"`` or ``"conveyor"``.
        config: A directory with the model's transformers ``config.json``.
        max_shard_size: The largest safetensors file (``to="transformers"``): bytes, or
            text as transformers reads it (``"5GB"``).
        buffer: The most bytes of small tensors read at once.

    Returns:
        What was written.

    Raises:
        ConfigError: For an unknown ``to``, a bad ``max_shard_size``, or a ``config``
            without a ``config.json``.
        CheckpointError: If ``src`` holds no checkpoint of the other format, ``out`` is a
            file or a non-empty directory that is not a checkpoint of format ``to``, or
            reading or writing fails.
    """
    limit = check(src, out, to, config, max_shard_size)
    source, target = Path(src), Path(out)
    config_dir = Path(config) if config is not None else None
    model = _meta_model(config_dir) if config_dir is not None else None
    if to == "conveyor":
        return Conversion(target, to, *to_conveyor(source, target, model))
    done = Conversion(target, to, *to_transformers(source, target, model, config_dir, limit,
                                                    buffer))  # fmt: skip
    if done.note:
        warnings.warn(done.note, stacklevel=2)
    return done


# ------------------------------------------------------------------ paths and the model
def check(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    to: str,
    config: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = "5GB",
) -> int:
    """The checks :func:`convert` makes before it reads or writes anything.

    Returns:
        ``max_shard_size`` in bytes.

    Raises:
        ConfigError: For an unknown ``to``, a bad ``max_shard_size``, or a ``config``
            without a ``config.json``.
        CheckpointError: If ``src`` holds no checkpoint of the other format, or ``out``
            is a file or a non-empty directory that is not a checkpoint of format ``to``.
    """
    if to not in TARGETS:
        raise ConfigError(f"to must be 'transformers' or 'conveyor', got {to!r}")
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config is not None and not (Path(config) / "config.json").is_file():
        raise ConfigError(
            f"--config {config} has no config.json; pass the directory of the model's "
            f"transformers config (what config.save_pretrained writes)"
        )
    _check_source(Path(src), to)
    _check_out(Path(src), Path(out), to)
    return limit


def _is_transformers(path: Path) -> bool:
    """Whether ``path`` is a transformers checkpoint directory or a safetensors file."""
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / SINGLE).is_file() or (path / INDEX).is_file()


def _check_source(src: Path, to: str) -> None:
    """A CheckpointError unless ``src`` holds a checkpoint of the other format."""
    if not src.exists():
        raise CheckpointError(f"no checkpoint at {src}: the path does not exist; check it")
    if to == "transformers" and not exists(src):
        other = " (a transformers checkpoint: use --to conveyor)" if _is_transformers(src) else ""
        raise CheckpointError(
            f"{src} is not a conveyor checkpoint{other}; pass a directory written by conveyor.save"
        )
    if to == "conveyor" and not _is_transformers(src):
        other = " (a conveyor checkpoint: use --to transformers)" if exists(src) else ""
        raise CheckpointError(
            f"{src} is not a transformers checkpoint{other}; pass a directory with "
            f"{SINGLE} or {INDEX}, or a .safetensors file"
        )


def _check_out(src: Path, out: Path, to: str) -> None:
    """A CheckpointError unless ``out`` is new, empty, or a checkpoint of format ``to``."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"cannot write to {out}: it is a file; pass a directory")
    if out.exists() and out.resolve() == src.resolve():
        raise CheckpointError(f"cannot convert {src} into itself; pass another output directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    ours = (out / LATEST).is_file() if to == "conveyor" else holds_checkpoint(out)
    if not ours:
        kind = "conveyor checkpoint" if to == "conveyor" else "transformers checkpoint"
        raise CheckpointError(
            f"{out} is not empty and holds no {kind}, so it is not overwritten; pass a new or "
            f"empty directory"
        )


def _meta_model(config: Path) -> nn.Module:
    """The transformers model of ``config`` (a directory with config.json), its parameters
    on the meta device: its names, shapes and weight conversions, no memory."""
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(config))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"--config {config}: transformers cannot read its config.json ({exc}); pass the "
            f"directory of the model's transformers config"
        ) from None
    classes = [getattr(transformers, a, None) for a in (cfg.architectures or [])]
    auto: Any = transformers.AutoModelForCausalLM
    with empty_weights():
        cls = next((c for c in classes if c is not None), None)
        if cls is not None:
            model: nn.Module = cls(cfg)
            return model
        try:
            model = auto.from_config(cfg)
        except ValueError:  # not a causal LM: the base model
            auto = transformers.AutoModel
            model = auto.from_config(cfg)
        return model
