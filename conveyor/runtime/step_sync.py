"""The interface of the work over other ranks that a step does around its actions."""

from __future__ import annotations

from conveyor.runtime.program import RankProgram
from conveyor.schedules import Action


class StepSync:
    """Work over other ranks that a step does around its actions: the data-parallel and
    tied-weight sums of the gradients, FSDP's gathers and reduce-scatters.

    The engine calls :meth:`begin` before the step's first action, :meth:`before_action`
    and :meth:`after_action` around every action, :meth:`before_pass` before every pass of
    the stage ends, :meth:`finish` after the last (every
    member of a group at the same point of the same program: NCCL's order), and
    :meth:`abort` when the step failed. The defaults do nothing.
    """

    def begin(self, program: RankProgram) -> None:
        """A step of ``program`` (its mode: ``program.train``) starts."""

    def before_action(self, action: Action) -> None:
        """``action`` is about to run (FSDP waits for its stage's gather)."""

    def before_pass(self) -> None:
        """A pass of the stage ends is about to run (FSDP waits for the gather of the
        units beside the stages)."""

    def after_action(self, action: Action) -> None:
        """``action`` ran (a reduction may start as soon as a stage's gradients are final)."""

    def finish(self) -> None:
        """The step's actions are done: complete the reduction."""

    def abort(self) -> None:
        """The step failed: drop what is in flight."""
