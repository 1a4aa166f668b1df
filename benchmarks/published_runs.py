"""Published numbers of real pipeline-parallel training runs, for checking a step-time predictor.

Each ``Run`` is one cell group of a published table: the model, the parallel layout, the
schedule in conveyor's names, and what the authors measured. ``conveyor.planning.estimate`` is
meant to be compared with these rows; nothing here imports torch or conveyor.

Sources (short key, citation, table):

- ``zb-table4``: P. Qi, X. Wan, G. Huang, M. Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024,
  arXiv 2401.10241 (v1), Table 4 (throughput and memory) with Table 3 (models and settings).
- ``megatron-table1``: D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary,
  V. Korthikanti, D. Vainbrand, P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee,
  M. Zaharia, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  SC '21, arXiv 2104.04473, Table 1 (weak scaling, 1.7B to 1T parameters). Per-row micro-batch
  sizes and interleaving come from the authors' reproduction script
  ``examples/sc21/run_table_1.sh`` of NVIDIA/Megatron-LM (read in the copy kept by
  sail-sg/zero-bubble-pipeline-parallelism, ``examples/academic_paper_scripts/sc21/``).
- ``torchtitan-405b``: the torchtitan team, ``benchmarks/llama3_h100_202412_torchtitan.md`` of
  pytorch/torchtitan (December 2024), Table 5 (Llama 3.1 405B, 512 GPUs, 1F1B against
  Interleaved 1F1B) and Table 6 (1F1B with context parallelism, 32K to 256K tokens). The
  torchtitan paper (W. Liang et al., ICLR 2025, arXiv 2410.06511) was not found in the stored
  copies, so its tables were not compared with this file.
- ``llama3-table4``: Llama Team, AI @ Meta (A. Dubey et al.), "The Llama 3 Herd of Models",
  arXiv 2407.21783, Table 4 (scaling configurations of 405B pre-training) with Table 3 (model).

Values a source does not give are assumed and said so, per row, in ``Run.assumed``. Memory is
in GB (10^9 bytes); torchtitan's GiB are converted and the printed value kept in ``note``.

Megatron's FLOP count (its equation 3), for reading ``tflops_per_gpu`` of ``megatron-table1``:
with B sequences per iteration, s the sequence length, l layers, h the hidden size and V the
vocabulary, F = 96 * B * s * l * h^2 * (1 + s / (6 h) + V / (16 l h)). It counts only the GEMMs
of the transformer layers and the logit layer, and it includes the extra forward pass of full
activation recomputation (a step without recomputation does 3/4 of the layer GEMMs). Achieved
TFLOP/s per GPU is F / (iteration time * GPUs); ``megatron_flops`` below evaluates it.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30 / 1e9
"""GB per GiB."""


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer as a source describes it.

    ``arch`` is "gpt" (GPT-2 style: GELU MLP of ``ffn`` = 4h, learned positions, LayerNorm) or
    "llama" (SwiGLU MLP of ``ffn``, RoPE, RMSNorm, untied output head).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    arch: str
    tied_embeddings: bool


@dataclass(frozen=True)
class Framework:
    """How a training framework ran a published row, in conveyor's ``Layout`` terms.

    ``split``: where its layers sit (``Layout.balance``: ``"even"`` or ``"ends"``);
    ``recompute``: what full recompute re-runs (``"layer"``: each transformer layer from its
    input); ``dp_overlap``: when its gradient reduction runs (``Layout.dp_overlap``);
    ``p2p_overlap``: whether its pipeline sends run beside the compute;
    ``attention``: ``"flash"`` (a fused kernel) or ``"math"`` (the scores materialized and
    saved); ``sources``: where each of these is stated.
    """

    name: str
    split: str
    recompute: str
    dp_overlap: str
    p2p_overlap: bool
    attention: str
    sources: str


FRAMEWORKS: dict[str, Framework] = {
    "zero-bubble": Framework(
        "Zero Bubble's Megatron-LM fork (sail-sg, 2023)",
        "ends",
        "layer",
        "none",
        False,
        "math",
        "first and last stages one layer fewer: the paper's section 5.1; no recompute and "
        "no data parallelism in Table 4; examples/pretrain_zero_bubble.sh at the tag "
        "zero-bubble-v0.1.0 passes no --use-flash-attn (Megatron's unfused attention) "
        "and no --overlap-p2p-communication (Megatron waits for its sends)",
    ),
    "megatron-lm": Framework(
        "Megatron-LM (2021)",
        "even",
        "layer",
        "none",
        False,
        "math",
        "layers split evenly (every Table 1 row divides); full recompute per layer "
        "(--activations-checkpoint-method uniform); gradients all-reduced after the "
        "backward (its 2021 DistributedDataParallel); unfused attention (2021, before "
        "FlashAttention); point-to-point calls that wait for their sends",
    ),
    "torchtitan": Framework(
        "torchtitan (December 2024)",
        "ends",
        "layer",
        "backward",
        True,
        "flash",
        "generate_split_points gives the first and last stages one layer fewer here "
        "([15, 16 x 6, 15], [7, 8 x 14, 7]); full activation checkpointing per block; "
        "FSDP2 reduce-scatters during the backward",
    ),
    "llama3": Framework(
        "Meta's Llama 3 training stack (2024)",
        "ends",
        "layer",
        "backward",
        True,
        "flash",
        "first and last stages one layer fewer (section 3.3.2); FSDP that does not "
        "reshard after the forward, its reduce-scatters overlapped with the backward",
    ),
}
"""The frameworks the published rows ran on (a prediction is of conveyor's runtime laid
out as they laid theirs)."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """One published measurement: a model on a parallel layout under one schedule.

    ``schedule`` uses conveyor's names ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2",
    "zb-auto"); ``chunks`` is the model chunks per pipeline rank; ``microbatch_cap`` is
    zb-auto's cap on micro-batches of activations held at once (p for ZB-1p, 2p for ZB-2p).
    ``global_batch`` counts sequences per optimizer step; ``recompute`` means full activation
    recomputation. Rows of one setting (same model, layout and batch) share ``label``.
    """

    source: str
    label: str
    model: Model
    framework: str
    hardware: str
    gpus: int
    pp: int
    tp: int
    dp: int
    cp: int = 1
    fsdp: bool = False
    schedule: str
    chunks: int = 1
    microbatch_cap: int | None = None
    microbatch_size: int
    global_batch: int
    seq: int
    recompute: bool
    measured: dict[str, float]
    assumed: tuple[str, ...] = ()
    note: str = ""

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline per step (per data-parallel replica)."""
        return self.global_batch // (self.microbatch_size * self.dp)


@dataclass(frozen=True)
class Source:
    """A published table: its citation and the measured quantities every row of it has."""

    citation: str
    kinds: tuple[str, ...]


SOURCES: dict[str, Source] = {
    "zb-table4": Source(
        "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, arXiv 2401.10241, Table 4",
        ("samples_per_s_per_gpu", "memory_gb"),
    ),
    "megatron-table1": Source(
        "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters "
        "Using Megatron-LM, SC '21, arXiv 2104.04473, Table 1",
        ("tflops_per_gpu", "mfu"),
    ),
    "torchtitan-405b": Source(
        "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 5 and 6",
        ("tokens_per_s_per_gpu", "memory_gb"),
    ),
    "llama3-table4": Source(
        "Llama Team, The Llama 3 Herd of Models, arXiv 2407.21783, Table 4",
        ("tflops_per_gpu", "mfu"),
    ),
}


def megatron_flops(model: Model, batch: int) -> float:
    """Megatron-LM SC '21 equation 3: GEMM FLOPs of one iteration of ``batch`` sequences,
    counting the recomputed forward pass."""
    s, h, n, v = model.seq, model.hidden, model.layers, model.vocab
    return 96 * batch * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


# --- Zero Bubble (Qi et al.), Tables 3 and 4 -------------------------------------------------

# Read in two stored conversions of arXiv v1 (they agree). Table 3 there gives the 6.2B model
# 32 heads (benchmarks/papers.py has 64), and Table 5 gives ZB-2p 0.0054 at 14.6B m=64
# (papers.py has 0.0070): the ICLR version may differ; it was not found in stored copies.
_ZB_MODELS = {  # Table 3: layers, heads, hidden; sequence 1024 for all
    "1.5B": (22, 24, 2304),
    "6.2B": (30, 32, 4096),
    "14.6B": (46, 40, 5120),
    "28.3B": (62, 48, 6144),
}
_ZB_SETTINGS = {  # Table 3: pipelines (GPUs), micro-batch size, micro-batch counts
    "1.5B": (8, 6, (24, 32, 64)),
    "6.2B": (8, 3, (24, 32, 64)),
    "14.6B": (16, 1, (48, 64, 128)),
    "28.3B": (32, 1, (96, 128, 256)),
}
# Table 4, per model, per micro-batch count in Table 3's order: samples per GPU per second.
_ZB_THROUGHPUT = {
    "ZB-2p": {
        "1.5B": (14.5, 14.8, 14.9),
        "6.2B": (4.32, 4.35, 4.39),
        "14.6B": (1.81, 1.83, 1.85),
        "28.3B": (0.99, 1.00, 1.00),
    },
    "ZB-1p": {
        "1.5B": (12.9, 13.4, 14.2),
        "6.2B": (3.88, 4.00, 4.20),
        "14.6B": (1.61, 1.67, 1.76),
        "28.3B": (0.87, 0.90, 0.96),
    },
    "1F1B": {
        "1.5B": (11.8, 12.5, 13.6),
        "6.2B": (3.50, 3.70, 4.03),
        "14.6B": (1.40, 1.49, 1.64),
        "28.3B": (0.76, 0.80, 0.88),
    },
    "1F1B-I": {
        "1.5B": (13.1, 13.4, 13.9),
        "6.2B": (4.01, 4.08, 4.19),
        "14.6B": (1.54, 1.59, 1.66),
        "28.3B": (0.82, 0.85, 0.90),
    },
}
# Table 4 "Memory (GB)": one value per model and schedule, the same for all three m.
_ZB_MEMORY = {
    "ZB-2p": {"1.5B": 59, "6.2B": 70, "14.6B": 51, "28.3B": 74},
    "ZB-1p": {"1.5B": 32, "6.2B": 42, "14.6B": 33, "28.3B": 44},
    "1F1B": {"1.5B": 30, "6.2B": 39, "14.6B": 32, "28.3B": 43},
    "1F1B-I": {"1.5B": 40, "6.2B": 48, "14.6B": 39, "28.3B": 58},
}
_ZB_ASSUMED = (
    "vocabulary not stated in the paper: 32,000 assumed (the authors' script "
    "examples/pretrain_zero_bubble.sh at tag zero-bubble-v0.1.0, seq 1024 as in Table 3, uses "
    "a SentencePiece tokenizer of unstated size)",
    "tied input/output embeddings assumed (that script does not untie them, Megatron's default)",
    "tensor and data parallel 1: Table 3 gives 'Pipelines (GPUs)' equal to #GPU",
    "no activation recomputation: not mentioned; the paper's memory model stores activations",
    "fp16 mixed precision assumed (that script's default)",
    "Memory (GB) taken as the peak over GPUs of per-GPU memory; the paper does not say",
    "first and last stages hold one layer fewer than the others (Section 5.1)",
)


def _zb_runs() -> list[Run]:
    runs = []
    for name, (layers, heads, hidden) in _ZB_MODELS.items():
        model = Model(name, layers, hidden, heads, heads, 4 * hidden, 32000, 1024, "gpt", True)
        p, b, counts = _ZB_SETTINGS[name]
        for column, m in enumerate(counts):
            for row in ("1F1B", "1F1B-I", "ZB-1p", "ZB-2p"):
                schedule, chunks, cap = {
                    "1F1B": ("1f1b", 1, None),
                    "1F1B-I": ("interleaved-1f1b", (layers + 2) // p, None),
                    "ZB-1p": ("zb-auto", 1, p),
                    "ZB-2p": ("zb-auto", 1, 2 * p),
                }[row]
                extra = (
                    (
                        f"chunks {chunks}: the paper uses 'each transformer layer as a chunk'; "
                        f"{layers} layers (first/last stage one fewer) give at most {chunks} "
                        "layers per stage",
                    )
                    if row == "1F1B-I"
                    else ()
                )
                runs.append(
                    Run(
                        source="zb-table4",
                        label=f"{name} m={m}",
                        model=model,
                        framework="zero-bubble",
                        hardware="a100-80g",
                        gpus=p,
                        pp=p,
                        tp=1,
                        dp=1,
                        schedule=schedule,
                        chunks=chunks,
                        microbatch_cap=cap,
                        microbatch_size=b,
                        global_batch=b * m,
                        seq=1024,
                        recompute=False,
                        measured={
                            "samples_per_s_per_gpu": _ZB_THROUGHPUT[row][name][column],
                            "memory_gb": float(_ZB_MEMORY[row][name]),
                        },
                        assumed=_ZB_ASSUMED + extra,
                        note=f"Table 4, column {name} #Microbatch {m}, row '{row}'",
                    )
                )
    return runs


# --- Megatron-LM SC '21 (Narayanan et al.), Table 1 ------------------------------------------

# Table 1: parameters (billion), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU,
# percent of peak, aggregate PFLOP/s; then from run_table_1.sh: micro-batch size and layers
# per virtual pipeline stage (0: no interleaving).
_MEGATRON = (
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4, 16, 0),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8, 16, 0),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2, 16, 0),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6, 8, 0),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8, 4, 0),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8, 2, 5),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1, 2, 5),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4, 1, 3),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2, 1, 1),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0, 1, 0),
)


def _megatron_runs() -> list[Run]:
    runs = []
    for (
        name,
        heads,
        hidden,
        layers,
        tp,
        pp,
        gpus,
        batch,
        tflops,
        percent,
        aggregate,
        mbs,
        per_virtual,
    ) in _MEGATRON:
        model = Model(name, layers, hidden, heads, heads, 4 * hidden, 51200, 2048, "gpt", True)
        chunks = layers // pp // per_virtual if per_virtual else 1
        assumed = [
            f"micro-batch size {mbs}: not in Table 1; from the authors' run_table_1.sh",
            "full activation recomputation: run_table_1.sh passes --activations-checkpoint-"
            "method uniform for every row, and equation 3 counts the recomputed forward",
            "fp16 mixed precision (CONFIG.sh of the sc21 scripts passes --fp16)",
            "tied input/output embeddings (Megatron GPT of 2021 always tied them)",
            "vocabulary 51,200 as the paper states (GPT-2 BPE padded)",
        ]
        if pp == 1:
            assumed.append("no pipeline (pp 1): schedule '1f1b' with one stage is plain DP/TP")
        elif per_virtual:
            assumed.append(
                f"interleaved with {chunks} chunks: run_table_1.sh sets "
                f"--num-layers-per-virtual-pipeline-stage {per_virtual} ({layers} layers / "
                f"{pp} stages); the paper says all Table 1 runs use the interleaved schedule "
                "with scatter/gather"
            )
        else:
            assumed.append(
                "non-interleaved 1F1B: run_table_1.sh gives this row no virtual pipeline "
                "stages, although Section 5.1 says Table 1 uses the interleaved schedule"
            )
        runs.append(
            Run(
                source="megatron-table1",
                label=name,
                model=model,
                framework="megatron-lm",
                hardware="a100-80g",
                gpus=gpus,
                pp=pp,
                tp=tp,
                dp=gpus // (tp * pp),
                schedule="interleaved-1f1b" if per_virtual else "1f1b",
                chunks=chunks,
                microbatch_size=mbs,
                global_batch=batch,
                seq=2048,
                recompute=True,
                measured={"tflops_per_gpu": float(tflops), "mfu": percent / 100},
                assumed=tuple(assumed),
                note=f"Table 1, row {name[:-1]} (billion): {tflops} TFLOP/s per GPU, {percent}% of "
                f"peak, {aggregate} PFLOP/s aggregate",
            )
        )
    return runs


# --- torchtitan, Llama 3.1 405B on 512 H100s ------------------------------------------------

# torchtitan's 405B flavor (dim 16384, 126 layers, 128 heads, 8 KV heads, FFN 53,248 from its
# ffn_dim_multiplier 1.2 and multiple_of 4096); vocabulary of its tiktoken tokenizer: 128,000
# BPE tokens plus 256 reserved special tokens.
_TITAN_405B = Model("llama3.1-405b", 126, 16384, 128, 8, 53248, 128256, 8192, "llama", False)
_TITAN_ASSUMED = (
    "sequence length 8,192: Table 5 does not say; train_configs/llama3_405b.toml at the "
    "benchmarked commit 9dec370 sets seq_len 8192",
    "micro-batch size 4: not stated; torchtitan's default splits the local batch of 32 into "
    "pipeline_parallel_microbatches = pp = 8 micro-batches",
    "hardware: H100 with 96 GB HBM2e at 2.4 TB/s and a 500 W limit (the page's own words), "
    "not the 80 GB SXM5 preset; its peak is between SXM and NVL and unknown",
    "Float8 linear layers (torch.compile + Float8 + AsyncTP), so a BF16 MFU does not apply",
    "memory is the maximum over all GPUs of peak memory (the page's footnote)",
)


def _titan_runs() -> list[Run]:
    rows = (
        ("1F1B", "1f1b", 1, 100.0, 82.5, ()),
        (
            "Interleaved 1F1B",
            "interleaved-1f1b",
            2,
            128.0,
            72.7,
            (
                "2 chunks per rank: not stated; torchtitan's generate_split_points gives looped "
                "schedules 2 stages per rank when no split points are set",
            ),
        ),
    )
    return [
        Run(
            source="torchtitan-405b",
            label="405B 512xH100 FSDP8 TP8 PP8",
            model=_TITAN_405B,
            framework="torchtitan",
            hardware="h100-sxm",
            gpus=512,
            pp=8,
            tp=8,
            dp=8,
            fsdp=True,
            schedule=schedule,
            chunks=chunks,
            microbatch_size=4,
            global_batch=256,
            seq=8192,
            recompute=True,
            measured={"tokens_per_s_per_gpu": tps, "memory_gb": gib * GIB},
            assumed=_TITAN_ASSUMED + extra,
            note=f"Table 5, row '{row}': {tps:g} TPS/GPU, {gib} GiB; local batch 32, global "
            "batch 256, full activation checkpointing",
        )
        for row, schedule, chunks, tps, gib, extra in rows
    ] + [
        Run(
            source="torchtitan-405b",
            label=f"405B 512xH100 FSDP{fsdp} CP{cp} seq {seq}",
            model=_TITAN_405B,
            framework="torchtitan",
            hardware="h100-sxm",
            gpus=512,
            pp=8,
            tp=8,
            dp=fsdp,
            cp=cp,
            fsdp=True,
            schedule="1f1b",
            microbatch_size=1,
            global_batch=8 * fsdp,
            seq=seq,
            recompute=True,
            measured={"tokens_per_s_per_gpu": tps, "memory_gb": gib * GIB},
            assumed=(
                "global batch 8 x FSDP degree: the page gives local batch size 8 only",
                "micro-batch size 1: not stated; torchtitan's default of pp = 8 micro-batches",
                *_TITAN_ASSUMED[2:],
            ),
            note=f"Table 6, row 'FSDP {fsdp}, CP {cp}', sequence {seq}: {tps:g} TPS/GPU, "
            f"{gib} GiB; 4D (FSDP + TP 8 + PP 8 + CP), 1F1B, local batch 8, full AC",
        )
        for fsdp, cp, seq, tps, gib in (
            (8, 1, 32768, 76.0, 75.3),
            (4, 2, 65536, 47.0, 75.9),
            (2, 4, 131072, 31.0, 77.1),
            (1, 8, 262144, 16.0, 84.9),
        )
    ]


# --- Llama 3 (Dubey et al.), Tables 3 and 4 --------------------------------------------------

_LLAMA3_405B = Model("llama3-405b", 126, 16384, 128, 8, 53248, 128000, 8192, "llama", False)
_LLAMA_ASSUMED = (
    "micro-batch size 1: not stated",
    "interleaved with 2 chunks per rank: the paper uses an interleaved schedule with V stages "
    "per rank and a tunable N, but gives neither",
    "hardware: H100 80 GB HBM3 at 700 W, 8 per server on NVLink, RoCE 400 Gbps between GPUs "
    "(Section 3.3.1); BF16 MFU as the paper reports it",
    "first and last pipeline stages hold one layer fewer (Section 3.3.2)",
    "vocabulary 128,000 as Table 3 prints it (the released tokenizer adds 256 special tokens)",
)


def _llama_runs() -> list[Run]:
    # GPUs, TP, CP, PP, DP, seq, batch per DP, TFLOPs/GPU, BF16 MFU (%)
    rows = (
        (8192, 8, 1, 16, 64, 8192, 32, 430, 43),
        (16384, 8, 1, 16, 128, 8192, 16, 400, 41),
        (16384, 8, 16, 16, 8, 131072, 16, 380, 38),
    )
    runs = []
    for gpus, tp, cp, pp, dp, seq, per_dp, tflops, mfu in rows:
        extra: tuple[str, ...] = (
            "no activation checkpointing: the paper says so for 8K sequences",
        )
        if cp > 1:
            extra = (
                "no activation checkpointing assumed at 128K too: the paper only says so "
                "for 8K sequences",
                "DP 8: arXiv v3 prints 8; earlier versions print 4, which does not multiply "
                "to 16,384 GPUs",
            )
        runs.append(
            Run(
                source="llama3-table4",
                label=f"{gpus} GPUs seq {seq}",
                model=_LLAMA3_405B,
                framework="llama3",
                hardware="h100-sxm",
                gpus=gpus,
                pp=pp,
                tp=tp,
                dp=dp,
                cp=cp,
                fsdp=True,
                schedule="interleaved-1f1b",
                chunks=2,
                microbatch_size=1,
                global_batch=per_dp * dp,
                seq=seq,
                recompute=False,
                measured={"tflops_per_gpu": float(tflops), "mfu": mfu / 100},
                assumed=_LLAMA_ASSUMED + extra,
                note=f"Table 4, row {gpus:,} GPUs, Seq. Len. {seq:,}: batch size/DP {per_dp}, "
                f"16M tokens/batch, {tflops} TFLOPs/GPU, {mfu}% BF16 MFU",
            )
        )
    return runs


RUNS: tuple[Run, ...] = (*_zb_runs(), *_megatron_runs(), *_titan_runs(), *_llama_runs())
"""Every row of the four sources."""


def by_source(key: str) -> tuple[Run, ...]:
    """The rows of one source, in table order.

    Raises:
        KeyError: If ``key`` names no source.
    """
    if key not in SOURCES:
        raise KeyError(f"unknown source {key!r}; known: {sorted(SOURCES)}")
    return tuple(run for run in RUNS if run.source == key)


def settings(key: str) -> dict[str, tuple[Run, ...]]:
    """The rows of one source grouped by ``label``: one setting measured under each schedule
    (for ratios of schedules on the same setting)."""
    groups: dict[str, list[Run]] = {}
    for run in by_source(key):
        groups.setdefault(run.label, []).append(run)
    return {label: tuple(runs) for label, runs in groups.items()}
