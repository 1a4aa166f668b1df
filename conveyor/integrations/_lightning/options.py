"""The strategy's keywords: ``conveyor.init``'s and ``Pipeline``'s, read from their
signatures (so a keyword either gains works here unchanged), and the ones it refuses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError
from conveyor.integrations._keywords import INIT_KEYS, pipeline_keys

NOT_OPTIONS = {
    "self": "",
    "model": "the network is the LightningModule's attribute (module_attr=)",
    "loss_fn": "set the LightningModule's loss_fn attribute (None: the network's own loss)",
    "context": "pass pp=, dp= (and conveyor.init's other keywords) to the strategy",
    "autocast": "use L.Trainer(precision='bf16-mixed')",
}
"""``Pipeline`` keywords the strategy sets itself, and what to do instead."""

START_METHODS = ("popen", "spawn", "fork")


@dataclass(frozen=True)
class StrategyOptions:
    """The strategy's keywords, sorted.

    Attributes:
        init_options: ``conveyor.init``'s (``pp`` and ``dp`` always).
        pipeline_options: ``Pipeline``'s.
    """

    init_options: dict[str, Any]
    pipeline_options: dict[str, Any]

    @classmethod
    def sort(
        cls, pp: int | None, dp: int, start_method: str, options: Mapping[str, Any]
    ) -> StrategyOptions:
        """Sort ``options`` into ``conveyor.init``'s and ``Pipeline``'s.

        Raises:
            ConfigError: a keyword the strategy sets itself or neither takes, or an
                unknown ``start_method``, in one sentence.
        """
        refused = sorted(set(options) & set(NOT_OPTIONS))
        if refused:
            name = refused[0]
            raise ConfigError(f"PipelineStrategy does not take {name}=; {NOT_OPTIONS[name]}")
        init_keys = [k for k in INIT_KEYS if k not in ("pp", "dp")]
        pipe_keys = list(pipeline_keys(NOT_OPTIONS))
        unknown = sorted(set(options) - set(init_keys) - set(pipe_keys))
        if unknown:
            raise ConfigError(
                f"PipelineStrategy does not know {unknown}; pass conveyor.init's {init_keys} "
                f"or conveyor.Pipeline's {pipe_keys}"
            )
        if start_method not in START_METHODS:
            raise ConfigError(
                f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}"
            )
        init_options: dict[str, Any] = {"pp": pp, "dp": dp}
        init_options.update({k: v for k, v in options.items() if k in init_keys})
        pipeline_options = {k: v for k, v in options.items() if k in pipe_keys}
        return cls(init_options, pipeline_options)
