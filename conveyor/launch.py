"""``python -m conveyor.launch``: the command line the public contract names for
``conveyor launch`` (:mod:`conveyor.cli.launch`), for environments without the script."""

import sys

from conveyor.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
