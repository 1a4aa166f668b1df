"""Context parallelism: each micro-batch's sequence cut over the ``cp`` ranks of a pipeline
rank, and attention over the whole sequence by passing keys and values around them.

:mod:`~conveyor.context_parallel.layout` says which tokens a cp rank holds (the causal load
balance), :mod:`~conveyor.context_parallel.blocks` is the attention math on one block of
keys, :mod:`~conveyor.context_parallel.rotation` moves blocks between the ranks, and
:mod:`~conveyor.context_parallel.attention` is the attention itself, forward and backward.
"""
