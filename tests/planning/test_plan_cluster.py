"""``conveyor plan --model CONFIG --hardware NAME --gpus N --seq S --global-batch B``: the
ranked table, the best layout's keywords, and the errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from transformers import LlamaConfig

from conveyor.cli.plan import main


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("llama")
    LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
    ).save_pretrained(where)
    return where


def test_ranks_every_layout_and_prints_the_best_as_keywords(
    config_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--model",
        str(config_dir / "config.json"),
        "--hardware",
        "a100-80g",
        "--gpus",
        "8",
        "--seq",
        "1024",
        "--global-batch",
        "16",
        "--top",
        "4",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    head = re.match(
        r"the (\d+) fastest layouts of 8 x a100-80g ranked in [\d.]+ s; 0 of them over the "
        r"80 GB limit",
        out,
    )
    assert head and int(head.group(1)) == 4
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 4
    speeds = [float(r.split("|")[12]) for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    first = [c.strip() for c in rows[0].split("|")[1:-1]]
    pp, tp, cp, dp = int(first[1]), int(first[2]), int(first[3]), int(first[4])
    assert pp * tp * cp * dp == 8
    best = out.splitlines()[-1]
    mesh = f"pp={pp}, dp={dp}, tp={tp}" + (f", cp={cp}" if cp > 1 else "")
    assert best.startswith(f"best: conveyor.init({mesh}); Pipeline(model, loss_fn=..., ")
    assert f'schedule="{first[7]}"' in best


def test_a_memory_limit_marks_layouts_over_it_and_exit_2_when_none_fits(
    config_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(config_dir), "--gpus", "4", "--seq", "512", "--global-batch", "8"]
    assert main([*args, "--memory-limit", "0.3", "--top", "500"]) == 0
    out = capsys.readouterr().out
    over = [line for line in out.splitlines() if line.endswith("over 0.3 |")]
    fits = [
        line
        for line in out.splitlines()
        if re.match(r"\| \d+ \|", line) and not line.endswith("over 0.3 |")
    ]
    assert fits and over
    assert out.index(fits[-1]) < out.index(over[0])  # every one that fits is ranked above
    assert main([*args, "--memory-limit", "0.000001"]) == 2
    out = capsys.readouterr().out
    assert (
        "conveyor plan: error: no layout fits 1e-06 GB per GPU (the smallest of these needs" in out
    )


def test_bad_input_is_one_line_that_says_what_to_do(
    config_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--model", str(config_dir), "--gpus", "8", "--seq", "512"])
    assert stop.value.code == 2
    assert "--model needs --global-batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    assert (
        "give FILE.py (plan on this machine) or --model CONFIG (plan a cluster)"
        in capsys.readouterr().err
    )
    assert (
        main(["--model", str(tmp_path), "--gpus", "8", "--seq", "512", "--global-batch", "8"]) == 2
    )
    assert f"no config at {tmp_path}; pass a transformers config.json" in capsys.readouterr().err
    assert (
        main(
            [
                "--model",
                str(config_dir),
                "--hardware",
                "tpu",
                "--gpus",
                "8",
                "--seq",
                "512",
                "--global-batch",
                "8",
            ]
        )
        == 2
    )
    assert "unknown hardware 'tpu'; use one of a100-80g, h100-sxm, h200" in capsys.readouterr().err
