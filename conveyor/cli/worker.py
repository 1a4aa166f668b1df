"""One worker of :mod:`conveyor.cli.launch`: runs the user's script and records how it failed.

``python -m conveyor.cli.worker [-m] TARGET ARGS...`` runs TARGET as ``python TARGET
ARGS`` (or ``python -m TARGET ARGS``) would. An exception that escapes the script is
printed as Python prints it (without this module's frames), and its type, one-line
message and time go to the error file torchrun gives each worker
(``TORCHELASTIC_ERROR_FILE``), so that the launcher can say which rank failed first and why.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from types import TracebackType

from conveyor.errors import one_line

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""The environment variable in which torchrun names each worker's error file."""


def write_error_file(path: str, error: BaseException) -> None:
    """Write ``error`` to ``path`` as torchrun's ``record`` decorator would, plus the time.

    The time is in seconds as a float: torchrun keeps whole seconds, too coarse to order
    ranks.

    Args:
        path: The worker's error file (``$TORCHELASTIC_ERROR_FILE``).
        error: The exception that ended the script.
    """
    now = time.time()
    data = {
        "message": {
            "message": one_line(error),
            "extraInfo": {"timestamp": str(int(now)), "time": now},
        }
    }
    with open(path, "w") as f:
        json.dump(data, f)


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the leading frames of this module and of runpy."""
    # runpy's code may be frozen: its frames then name "<frozen runpy>", not its file.
    skip = {__file__, runpy.__file__, runpy.run_path.__code__.co_filename}
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    return tb


def main(argv: list[str]) -> int:
    """Run the user's script or module as ``python [-m] TARGET ARGS...`` would.

    Args:
        argv: ``[-m] TARGET ARGS...``.

    Returns:
        1 after an exception (printed, and recorded in the error file), else 0.

    Raises:
        SystemExit: As the script raised it (recorded first when its code is a message).
        KeyboardInterrupt: As the script raised it.
    """
    as_module = argv[:1] == ["-m"]
    target, *args = argv[1:] if as_module else argv
    sys.argv = [target, *args]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # As for ``python script.py``: the script's folder comes first on the path.
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        path = os.environ.get(ERROR_FILE)
        if path and isinstance(exit_.code, str):  # sys.exit("message")
            write_error_file(path, exit_)
        raise
    except Exception as error:  # KeyboardInterrupt keeps its usual exit
        # Python prints the exception's own traceback, so that is the one to trim.
        error.with_traceback(_script_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        path = os.environ.get(ERROR_FILE)
        if path:
            write_error_file(path, error)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
