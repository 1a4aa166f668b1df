"""The cut of a micro-batch, value by value: which tokens each cp rank holds, global
positions, labels shifted before the cut, documents and padding of the whole sequence."""

from __future__ import annotations

import torch

from conveyor.context_parallel import install, layout
from conveyor.context_parallel.cut import Cut, documents


def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i() -> None:
    assert layout.held_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.held_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert layout.held_index(8, 4, 3).tolist() == [3, 4]
    # causal work (keys at or before each query) is the same on every rank
    for cp in (2, 4):
        work = [int((layout.held_index(32, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(work)) == 1, work
    t = torch.arange(32).view(2, 16)
    parts = [layout.cut(t, 1, 2, r) for r in range(2)]
    assert parts[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(layout.join(parts, 1), t)


def test_documents_restart_where_positions_do() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert documents(positions).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8]


def test_a_transformers_micro_batch() -> None:
    ids = torch.arange(16).view(2, 8)
    labels = ids + 100
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], list(range(8))])
    cut = Cut(cp=2, ranks=(1,), key=7, transformers=True, shift_labels=True)
    out = cut.inputs({"input_ids": ids, "labels": labels, "attention_mask": mask,
                      "position_ids": positions})  # fmt: skip
    # rank 1 holds chunks 1 and 2 of 4: tokens 2..5
    assert out["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["position_ids"].tolist() == [[2, 3, 0, 1], [2, 3, 4, 5]]
    # labels shifted over the whole row before the cut: token t predicts label t + 1
    assert out["shift_labels"].tolist() == [[103, 104, 105, 106], [111, 112, 113, 114]]
    assert torch.equal(out["labels"], out["shift_labels"])
    assert out[install.KEY] == 7
    assert out[install.DOC].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8]
    assert out[install.VALID].tolist() == [[True] * 8, [True] * 6 + [False] * 2]
    # a micro-batch without positions gets the global ones
    plain = cut.inputs({"input_ids": ids, "labels": labels})
    assert plain["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert install.DOC not in plain and install.VALID not in plain
    # the tokens this rank scores: its shifted labels that are not -100 (the last
    # token of each row predicts nothing)
    last = torch.full((2, 8), 5)
    assert int(Cut(2, (1,), 0, True, True).count(last)) == 8
    assert int(Cut(2, (0,), 0, True, True).count(last)) == 6


def test_stacked_ranks_in_one_process() -> None:
    ids = torch.arange(16).view(2, 8)
    cut = Cut(cp=2, ranks=(0, 1), key=0, transformers=True, shift_labels=False)
    out = cut.inputs({"input_ids": ids, "position_ids": torch.arange(8).expand(2, 8)})
    assert out["input_ids"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15], [2, 3, 4, 5],
                                         [10, 11, 12, 13]]  # fmt: skip
    assert out[install.DOC].shape == (4, 8)  # repeated per rank: every input has 4 rows


def test_next_token_targets_are_shifted_before_the_cut() -> None:
    targets = torch.arange(8).view(1, 8)
    cut = Cut(2, (0,), 0, False, False, shift_targets=-1)
    assert cut.targets(targets, 8).tolist() == [[1, 2, 7, -1]]
    assert Cut(2, (0,), 0, False, False).targets(targets, 8).tolist() == [[0, 1, 6, 7]]
