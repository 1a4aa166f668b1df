"""``conveyor convert CHECKPOINT OUT --to transformers|conveyor [--config DIR]``.

Turns one checkpoint format into the other, one tensor at a time (never the whole model
in memory): a conveyor checkpoint (conveyor.save, any layout) into a transformers
directory (safetensors files and their index) with --to transformers; a transformers
directory into a conveyor checkpoint (what conveyor.load, Pipeline(weights=) and
conveyor.load_model_state read) with --to conveyor.

--config DIR names a directory with the model's transformers config.json: --to
transformers copies it (and generation_config.json) into OUT and writes a transformers
model's mixture-of-experts experts as its own save_pretrained does, so that
from_pretrained reads OUT; --to conveyor stores the tensors under the names the model
has. OUT may be new, empty, or a checkpoint of the target format (then replaced).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``conveyor convert``: convert CHECKPOINT into OUT; print what was written.

    Args:
        argv: The arguments after ``conveyor convert`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 on bad input (a missing checkpoint, an OUT that
        is not a checkpoint, a bad flag), 1 when reading or writing fails.

    Raises:
        SystemExit: For ``--help`` (code 0) and for a usage error (code 2, printed in
            one line).
    """
    from conveyor.checkpoint.convert import TARGETS, check, convert
    from conveyor.cli._args import subcommand
    from conveyor.errors import CheckpointError, ConfigError

    parser = subcommand("conveyor convert", __doc__)
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="the checkpoint to convert")
    parser.add_argument("out", metavar="OUT", help="the directory to write")
    parser.add_argument(
        "--to", required=True, choices=TARGETS, help="the format to write: " + " or ".join(TARGETS)
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="DIR",
        help="a directory with the model's transformers config.json (default: none; --to "
        "transformers then writes no config)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="the largest safetensors file with --to transformers, as transformers reads "
        "it: bytes or text such as 5GB or 500MiB",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        check(args.checkpoint, args.out, args.to, args.config, args.max_shard_size)
    except (ConfigError, CheckpointError) as error:  # bad input: nothing read or written
        print(f"conveyor convert: error: {error}", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings(record=True):  # the note is printed below instead
            warnings.simplefilter("always")
            done = convert(
                args.checkpoint,
                args.out,
                to=args.to,
                config=args.config,
                max_shard_size=args.max_shard_size,
            )
    except ConfigError as error:  # --config that transformers cannot read
        print(f"conveyor convert: error: {error}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError) as error:  # reading or writing failed
        print(f"conveyor convert: error: {error}", file=sys.stderr)
        return 1
    gib = done.nbytes / 2**30
    size = f"{gib:.2f} GiB" if gib >= 0.1 else f"{done.nbytes / 2**20:.2f} MiB"
    print(f"wrote {done.tensors} tensors ({size}) as a {done.to} checkpoint to {done.path}")
    if done.note:
        print(f"conveyor convert: note: {done.note}", file=sys.stderr)
    return 0
