"""Every example runs when copied alone: it imports nothing from the other examples, and
``docs/guide/examples.md`` counts and describes exactly the scripts in ``examples/``."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NUMBERS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
# An extra an example needs; without it installed the example cannot be imported at all.
NEEDS = {
    "hf_llama": ["transformers"],
    "big_model": ["transformers"],
    "hf_trainer": ["transformers"],
    "lightning_gpt": ["lightning", "transformers"],
}

# Loads each copy in its own folder, the others nowhere on the path, and says what failed.
LOAD = """
import importlib.util, json, sys
out = {}
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[1][:-3]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out[name] = "ok" if callable(getattr(module, "main", None)) else "no main()"
    except BaseException as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    # conveyor from this checkout, and nothing of examples/ on the path
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _alone(tmp_path: Path, example: Path) -> Path:
    """``example`` copied into an empty folder of its own."""
    folder = tmp_path / example.stem
    folder.mkdir()
    return Path(shutil.copy(example, folder))


def _installed(name: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in NEEDS.get(name, []))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.stem)
def test_no_example_imports_another(example: Path) -> None:
    """The quick check: every module an example imports is installed, none is an example."""
    names = set()
    for node in ast.walk(ast.parse(example.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    assert not names & {e.stem for e in EXAMPLES}, names
    for name in names - {"__future__"}:
        if name in {n for needs in NEEDS.values() for n in needs} and not _installed(example.stem):
            continue
        assert importlib.util.find_spec(name) is not None, name


@pytest.mark.slow
def test_every_example_imports_when_copied_alone(tmp_path: Path) -> None:
    copies = [_alone(tmp_path, e) for e in EXAMPLES if _installed(e.stem)]
    assert len(copies) >= 2  # gpt.py and resnet.py need torch alone
    empty = tmp_path / "cwd"
    empty.mkdir()
    done = subprocess.run([sys.executable, "-c", LOAD, *map(str, copies)], cwd=empty,
                          env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == {c.stem: "ok" for c in copies}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "args", "says"),
    [
        ("gpt", ["--steps", "2", "--chars", "3000", "--width", "16", "--depth", "2",
                 "--context", "8", "--sample", "5"], "2 stages, 4 micro-batches, in one process"),
        ("nanogpt", ["--steps", "2", "--chars", "3000", "--n-embd", "16", "--n-layer", "2",
                     "--block-size", "8"], "2 stages, 4 micro-batches, in one process"),
        ("resnet", ["--steps", "1", "--base", "8", "--blocks", "1,1,1,1", "--batch-size", "8"],
         "held-out accuracy"),
    ],
)  # fmt: skip
def test_the_cheap_examples_run_copied_alone(
    tmp_path: Path, name: str, args: list[str], says: str
) -> None:
    copy = _alone(tmp_path, ROOT / "examples" / f"{name}.py")
    done = subprocess.run([sys.executable, copy.name, *args], cwd=copy.parent, env=_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert says in done.stdout


def test_the_examples_page_counts_and_describes_every_script() -> None:
    page = (ROOT / "docs" / "guide" / "examples.md").read_text()
    count = re.search(r"^(\w+) complete training scripts in `examples/`", page, re.M)
    assert count is not None
    assert NUMBERS.index(count.group(1).lower()) == len(EXAMPLES)
    described = re.findall(r"^## `(\w+\.py)`", page, re.M)
    assert sorted(described) == [e.name for e in EXAMPLES]
