"""Time of one transfer or collective among GPUs, by NCCL's own cost model.

NCCL picks an algorithm by its time = latency + bytes / bandwidth (``src/graph/tuning.cc``,
``ncclTopoGetAlgoTime``); the latencies here are its Simple-protocol ones (the protocol of
large messages): a base of 8.4 us, plus per step 3.4 us over NVLink (4.0 for a tree) and
14 us over the network. A ring all-reduce takes 2(n-1) steps and moves 2(n-1)/n of the
bytes through every link; all-gather and reduce-scatter take n-1 steps and move (n-1)/n.
A tree all-reduce crosses log2(nodes) network steps each way, at 0.92 of the bandwidth
(its protocol derate in the same file); NCCL takes the faster of the two, and so does
:func:`all_reduce`. Links run at 0.8 of their rate, the bus bandwidth ``nccl-tests``
measures on 8 A100s (234.9 of 300 GB/s) and 8 H200s (366 of 450 GB/s).

A measured link (:meth:`~conveyor.planning.devices.Hardware.measure`: ``latency_s`` > 0)
replaces NCCL's latencies: every step costs the measured latency, and its bandwidth is
used as measured.

A group of ``size`` ranks ``stride`` apart (:meth:`conveyor.planning.layout.Layout.group`)
lies inside one node when its ranks do, ranks packed onto nodes in order; otherwise its
data crosses the network, one adapter per GPU.
"""

from __future__ import annotations

import math

from conveyor.planning.devices import Hardware

LINK_EFFICIENCY = 0.8
BASE_LATENCY = 8.4e-6
NVLINK_STEP = 3.4e-6
NVLINK_TREE_STEP = 4.0e-6
NETWORK_STEP = 14e-6
TREE_DERATE = 0.92


def _nodes(hw: Hardware, size: int, stride: int) -> int:
    """Nodes a group of ``size`` ranks ``stride`` apart spans (ranks packed in order): all
    of it within ``gpus_per_node``, otherwise a node per ``gpus_per_node / stride`` ranks,
    and a node each once they are a node or more apart."""
    return max(1, min(size, math.ceil(size * stride / hw.gpus_per_node)))


def _bandwidth(hw: Hardware, nodes: int) -> float:
    rate = hw.intra_node_gbps if nodes == 1 else hw.inter_node_gbps
    return (1.0 if hw.latency_s else LINK_EFFICIENCY) * rate * 1e9


def _base(hw: Hardware) -> float:
    return 0.0 if hw.latency_s else BASE_LATENCY


def _step(hw: Hardware, nccl: float) -> float:
    return hw.latency_s or nccl


def p2p(hw: Hardware, nbytes: float, same_node: bool) -> float:
    """One send between two GPUs: a step's latency plus the bytes over the link."""
    step = _step(hw, NVLINK_STEP if same_node else NETWORK_STEP)
    return _base(hw) + step + nbytes / _bandwidth(hw, 1 if same_node else 2)


def all_reduce(hw: Hardware, nbytes: float, size: int, stride: int = 1) -> float:
    """A ring or tree all-reduce of ``nbytes`` among ``size`` ranks, the faster."""
    if size <= 1:
        return 0.0
    nodes = _nodes(hw, size, stride)
    bw = _bandwidth(hw, nodes)
    inter = 2 * (nodes - 1)
    ring = (
        _base(hw)
        + (2 * (size - 1) - inter) * _step(hw, NVLINK_STEP)
        + inter * _step(hw, NETWORK_STEP)
        + nbytes * 2 * (size - 1) / size / bw
    )
    per_node = max(1, size // nodes)
    tree = (
        _base(hw)
        + 2
        * (
            (per_node - 1) * _step(hw, NVLINK_TREE_STEP)
            + math.log2(nodes) * _step(hw, NETWORK_STEP)
        )
        + nbytes * 2 * (size - 1) / size / (TREE_DERATE * bw)
    )
    return min(ring, tree)


def all_gather(hw: Hardware, nbytes: float, size: int, stride: int = 1) -> float:
    """A ring all-gather (or reduce-scatter) whose whole result is ``nbytes``."""
    if size <= 1:
        return 0.0
    nodes = _nodes(hw, size, stride)
    inter = nodes - 1
    return (
        _base(hw)
        + (size - 1 - inter) * _step(hw, NVLINK_STEP)
        + inter * _step(hw, NETWORK_STEP)
        + nbytes * (size - 1) / size / _bandwidth(hw, nodes)
    )


reduce_scatter = all_gather


def all_to_all(hw: Hardware, nbytes: float, size: int, stride: int = 1) -> float:
    """An all-to-all where each rank sends ``nbytes`` in all, (size-1)/size of it away."""
    if size <= 1:
        return 0.0
    nodes = _nodes(hw, size, stride)
    step = _step(hw, NVLINK_STEP if nodes == 1 else NETWORK_STEP)
    return _base(hw) + step + nbytes * (size - 1) / size / _bandwidth(hw, nodes)
