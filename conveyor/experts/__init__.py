"""Expert parallelism: each expert collection of a mixture-of-experts model split over the
expert-parallel ranks, its tokens sent to their experts and back by all-to-all.

- :mod:`~conveyor.experts.collections` finds the expert collections (transformers' experts
  modules by default, or modules named by ``ep_plan`` patterns).
- :mod:`~conveyor.experts.shard` gives each ep rank its ``num_experts / ep`` experts as a
  DTensor ``Shard(0)`` under the original names, and routes the collection's forward.
- :mod:`~conveyor.experts.dispatch` is that forward: dispatch, local experts, combine.
- :mod:`~conveyor.experts.all_to_all` is the all-to-all, a custom op with autograd.
- :mod:`conveyor.runtime.expert_grads` says over which ranks each gradient is summed
  (data parallelism needs it, below this package).
"""

from __future__ import annotations

from conveyor.experts.collections import find_experts, is_experts_collection, num_experts
from conveyor.experts.shard import apply_ep, check_tp_plan, chosen, shard_experts
from conveyor.runtime.expert_grads import is_expert_parameter, reduction_group

__all__ = [
    "apply_ep",
    "check_tp_plan",
    "chosen",
    "find_experts",
    "is_expert_parameter",
    "is_experts_collection",
    "num_experts",
    "reduction_group",
    "shard_experts",
]
