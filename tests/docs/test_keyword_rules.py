"""Every rule between Pipeline's keywords is written once (``conveyor._rules``), checked
where it says, and listed in the reference page's table exactly as the code lists it."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor._options import Options
from conveyor._rules import RULES, Rule, check_schedule, ties_for_fsdp
from conveyor.schedules import get_schedule

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "conveyor.md"


def _documented() -> list[tuple[tuple[str, ...], str, str]]:
    text = PAGE.read_text()
    block = text.split("<!-- rules: begin -->")[1].split("<!-- rules: end -->")[0]
    rows = [line for line in block.strip().splitlines()[2:] if line.startswith("|")]
    out = []
    for row in rows:
        keywords, says, checked_by = (cell.strip() for cell in row.strip("|").split(" | "))
        out.append((tuple(re.findall(r"`([^`]+)`", keywords)), says, checked_by.strip("`")))
    return out


def test_the_docs_table_is_the_codes_list_of_rules() -> None:
    assert _documented() == [(r.keywords, r.says, r.checked_by) for r in RULES]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.checked_by.rsplit(".", 1)[1])
def test_each_rule_names_a_function_that_checks_it(rule: Rule) -> None:
    module, _, name = rule.checked_by.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))
    # ... and the library calls it (a rule nobody runs is not a rule)
    # (the registrations' own checked_by="..." strings are not calls)
    texts = [re.sub(r'checked_by="[^"]*"', "", p.read_text())
             for p in (ROOT / "conveyor").rglob("*.py")]  # fmt: skip
    calls = sum(len(re.findall(rf"\b{name}\b", t)) - t.count(f"def {name}(") for t in texts)
    assert calls >= 1, rule


def test_options_take_keywords_only() -> None:
    loss = nn.functional.mse_loss
    with pytest.raises(TypeError):
        Options(loss, 2)  # type: ignore[call-arg]
    assert Options(loss_fn=loss, microbatches=2, chunks=3).chunks == 3
    # Pipeline's keywords, less the three it settles itself, each under its own name
    keywords = set(inspect.signature(conveyor.Pipeline.__init__).parameters) - {"self", "model"}
    own = {f.name for f in dataclasses.fields(Options)}
    assert own == keywords - {"schedule", "context", "memory_limit"}


def _pipe(**kw: object) -> conveyor.Pipeline:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    keywords: dict[str, object] = {"loss_fn": nn.functional.mse_loss, "microbatches": 2}
    keywords.update(kw)
    return conveyor.Pipeline(model, context=conveyor.init(pp=2), **keywords)  # type: ignore[arg-type]


def test_memory_limit_without_the_planner_is_refused() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"^memory_limit is what schedule='auto' "
                       r"plans for; with schedule='1f1b' nothing reads it"):  # fmt: skip
        _pipe(memory_limit=2**30)


def test_chunks_other_than_a_given_schedules_are_refused() -> None:
    schedule = get_schedule("interleaved-1f1b", 2, 2, 2)
    with pytest.raises(conveyor.ConfigError, match=r"^schedule 'interleaved-1f1b' runs 2 "
                       r"chunk\(s\) per rank, but chunks=1; leave chunks out"):  # fmt: skip
        _pipe(schedule=schedule, chunks=1)
    pipe = _pipe(schedule=schedule)  # its own count, or the same given again
    assert _pipe(schedule=schedule, chunks=2).schedule.chunks == pipe.schedule.chunks == 2
    x = torch.randn(4, 4)
    assert float(pipe.train_step(x, x)) > 0


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"fsdp": True}, "fsdp=True shards over the data-parallel replicas"),
        ({"tp_plan": {"0": None}}, "tp_plan shards layers over tensor-parallel ranks"),
        ({"recompute": [5]}, "recompute names stage 5, but this pipeline's stages are 0..1"),
        ({"schedule": "auto"}, "schedule='auto' profiles the model on a batch"),
    ],
)
def test_rules_in_one_process(keywords: dict[str, object], message: str) -> None:
    with pytest.raises(conveyor.ConfigError, match=re.escape(message)):
        _pipe(**keywords)


def test_reshard_runs_with_every_schedule() -> None:
    """W reads no weight, so fsdp='reshard' takes split-backward schedules too."""
    options = Options(loss_fn=None, microbatches=4, fsdp="reshard")
    for name in ("1f1b", "zb-h1", "zb-h2"):
        check_schedule(options, get_schedule(name, 2, 4))


def test_stages_a_rank_count_cannot_share_out_are_refused() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    with pytest.raises(conveyor.ConfigError, match=r"^balance describe 3 stages, which 2 "
                       r"chunks per rank cannot share out"):  # fmt: skip
        conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=2,
                          schedule="interleaved-1f1b", balance=[1, 1, 1],
                          context=conveyor.init())  # fmt: skip


def test_a_weight_tied_on_one_rank_cannot_be_sharded_by_fsdp() -> None:
    ties = [({0: "embed.weight", 3: "head.weight"}, [0, 3])]
    ties_for_fsdp(ties, (0, 1, 0, 1))  # a loop: stages 0 and 3 on ranks 0 and 1
    shared = r"^fsdp cannot shard the weight 'embed.weight', which stages 0 and 3 of pipeline"
    with pytest.raises(conveyor.ConfigError, match=shared + r" rank 0 share"):
        ties_for_fsdp(ties, (0, 1, 1, 0))
