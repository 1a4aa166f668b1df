"""The keywords an integration passes on to conveyor: ``conveyor.init``'s and
``Pipeline``'s, read from their signatures, so a keyword either gains works in every
integration with no list to keep."""

from __future__ import annotations

import inspect
from collections.abc import Collection

from conveyor.context import init
from conveyor.pipeline import Pipeline

INIT_KEYS: tuple[str, ...] = tuple(inspect.signature(init).parameters)
"""``conveyor.init``'s keywords."""


def pipeline_keys(set_here: Collection[str]) -> tuple[str, ...]:
    """``Pipeline``'s keywords less ``set_here``, those the integration sets itself."""
    parameters = inspect.signature(Pipeline.__init__).parameters.items()
    kind = inspect.Parameter.KEYWORD_ONLY
    return tuple(n for n, p in parameters if p.kind is kind and n not in set_here)
