"""``python -m conveyor.cli``: the ``conveyor`` command."""

import sys

from conveyor.cli.command import main

sys.exit(main())
