"""conveyor's commands: ``conveyor`` (:mod:`conveyor.cli.command`) and the subcommands it
forwards to (``demo``, ``launch`` and its worker, ``plan``, ``trace``)."""
