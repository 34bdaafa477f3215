"""The performance model's constants: the fitted and counted numbers, ``PerfConstants`` (the bundle a
stack prices with) and ``MemoryPressure``.

Which set and how many of its rows fitted each constant, or that it was counted or calibrated on one
published figure: ``pipette.constant_sources``; their cross-validated verdicts: docs/results.md.

Data only, below ``pipette.stacks`` (which bundles one set of constants per stack) and
``pipette.perf`` (which prices a candidate with a stack's constants): the performance model takes a
stack by name without the stacks importing the model back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipette.efficiency import H100_MEASURED_BF16, EfficiencyCurve
from pipette.memory_options import MemoryOptions
from pipette.perf_moe import DEFAULT_MOE, MEGATRON_MOE, MoeConstants

# ---- fitted constants (tests/benchmarks/accuracy.py --fit) ---------------------------
# Achieved fraction of a link's bandwidth by NCCL collectives (bus bandwidth / link
# bandwidth). Fitted on the vTrain A100 and Ultra-Scale H100 sets together.
LINK_FRACTION = 1.0
# Achieved fraction of the summed NIC bandwidth when a tensor-parallel group crosses a
# node cut on one NCCL channel per member (pipette.comm.channel_links). Scanned on the
# Ultra-Scale H100 healthy rows (0.3..0.7; 0.4 best on tp 16/32, 8x H100 + EFA nodes).
# Data-parallel rings keep one link's speed: the same rule for them made the large-dp
# rows, already predicted too fast, worse (accuracy.py: healthy MAPE 33.9% -> 34.6%,
# median top-1 regret 6.7% -> 10.8%).
CUT_FRACTION = 0.4
# Fixed time per transformer layer per forward-equivalent pass (kernel launches,
# layer norms, residual adds, the small ops a GEMM count misses). vTrain + Ultra-Scale.
LAYER_OVERHEAD_S = 0.0
# Fraction of the last micro-batch's backward compute that hides the bucketed gradient
# reduction (and ZeRO-3 prefetched gathers). vTrain + Ultra-Scale.
DP_OVERLAP = 0.0
# Fixed cost of one blocking collective or p2p call on the critical path (NCCL launch and
# the skew of the ranks it synchronises). vTrain + Ultra-Scale.
COLLECTIVE_OVERHEAD_S = 0.0
# Activation-sized (T x h) memory passes per layer forward that no GEMM counts: norms,
# residual adds, dropout, bias and activation functions. Megatron-LM without sequence
# parallelism replicates the norms and residuals on every TP rank (Korthikanti et al.
# 2022, sec. 4.2.2), so these passes are not divided by tp. vTrain + Ultra-Scale.
ELEMENTWISE_PASSES = 11.7
# Passes over the attention scores (mbs x heads/tp x s x s) per layer forward: scale,
# mask, softmax, dropout in unfused attention (Korthikanti et al. 2022, eq. 2 counts
# these tensors). FlashAttention (Dao et al. 2022) never writes them. vTrain + Ultra-Scale.
SCORE_PASSES = 2.89

# ---- counted, not fitted ----------------------------------------------------------
# Bytes of memory touched per parameter by one mixed-precision Adam(W) step
# (Rajbhandari et al. 2020, sec. 3: fp32 master, momentum, variance, fp32 gradient read
# (16 B), the three fp32 states written back (12 B) and the low-precision copy written
# (2 B), plus two reads of the fp32 gradient for the overflow check and the norm clip (8 B).
ADAM_BYTES_PER_PARAM = 38.0
# SGD with momentum: master + momentum + gradient read, master + momentum + copy written,
# plus the two gradient reads.
SGD_BYTES_PER_PARAM = 30.0
# Fp32 softmax + cross-entropy over the logits: the loss reads the logits, writes fp32
# probabilities, and the backward reads them and writes the logit gradient: 4 passes of 4 B.
LOSS_BYTES_PER_LOGIT = 16.0
# A fused (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019 sec. 3; or a chunked)
# loss reads the bf16 logits once in the forward and writes their gradient once in the backward,
# in place: 2 passes of 2 B, the fp32 softmax kept in registers.
FUSED_LOSS_BYTES_PER_LOGIT = 4.0
# Bytes touched per element by FP8 dynamic scaling: an amax pass (2 B read) and the scaled cast
# (2 B read, 1 B written); torchao.float8 and Transformer Engine cast each GEMM operand so.
FP8_CAST_BYTES = 5.0


@dataclass(frozen=True)
class PerfConstants:
    """The fitted constants, bundled so the accuracy benchmark can refit them.

    ``curve=None`` uses the calibrated curve of the device's family
    (``pipette.efficiency.default_curve``). ``flash_attention``: the attention runs as one
    fused kernel (FlashAttention-2, PyTorch SDPA; Dao 2023) that never writes the scores: no
    score passes, the causal half of the attention FLOPs at the GEMM curve's efficiency, and a
    backward of 2.5x its forward (it recomputes the scores: 5 matmuls against 2; Dao 2023,
    sec. 3.1). ``ffn_passes``: memory passes over the MLP's ``T x f`` activations per layer
    forward (activation function and gating), beside ``elementwise_passes`` over ``T x h``.
    """

    link_fraction: float = LINK_FRACTION
    cut_fraction: float = CUT_FRACTION
    layer_overhead_s: float = LAYER_OVERHEAD_S
    dp_overlap: float = DP_OVERLAP
    collective_overhead_s: float = COLLECTIVE_OVERHEAD_S
    elementwise_passes: float = ELEMENTWISE_PASSES
    score_passes: float = SCORE_PASSES
    curve: EfficiencyCurve | None = field(default=None)
    flash_attention: bool = False
    ffn_passes: float = 0.0
    #: GEMM curves by device family for devices the probe has not measured (the profile's own
    #: measured points come first): (family, curve) pairs
    curves: tuple[tuple[str, EfficiencyCurve], ...] = ()
    #: Fraction of the device's peak a fused attention kernel reaches (0: the GEMM curve's
    #: efficiency at the attention matmul's size). FlashAttention-2 reaches 50-73% of an A100's
    #: peak in the forward and less in the backward (Dao 2023, sec. 4.1, fig. 4-6), far below a
    #: large GEMM at long sequences; with ``flash_attention`` only.
    attention_efficiency: float = 0.0
    #: ``attention_efficiency`` on other device families, by family (``pipette.efficiency.family``):
    #: a fraction of the peak fitted on one family does not carry to another whose peak the same
    #: kernel fills to another degree (FlashAttention-2: 50-73% of an A100's peak, Dao 2023; 35% of
    #: an H100's, Shah et al. 2024, "FlashAttention-3", sec. 1).
    attention_efficiencies: tuple[tuple[str, float], ...] = ()
    #: Fraction of a micro-batch's compute under which FSDP/ZeRO-3 parameter gathers and the
    #: gradient reduce-scatters run (None: the older ``dp_overlap`` rule). FSDP prefetches the
    #: next unit's all-gather on a separate stream while the current unit computes (forward and
    #: backward prefetch; PyTorch FSDP docs, "BackwardPrefetch"; FSDP2's implicit prefetching in
    #: torchtitan, docs/fsdp.md), and reduce-scatters a unit's gradients while the previous unit's
    #: backward runs: per phase only what the compute does not cover is exposed.
    shard_overlap: float | None = None
    #: Whether full recomputation gathers the sharded parameters a third time. DeepSpeed ZeRO-3
    #: re-gathers for the recomputed forward; FSDP's backward pre-hook gathers a unit once and the
    #: checkpointed forward is recomputed inside it (torch.distributed.fsdp, "activation
    #: checkpointing" with FSDP: the recomputation runs under the unit's unsharded parameters).
    recompute_regathers: bool = True
    #: Data-parallel collectives across nodes on one NCCL channel per member with this share of
    #: the summed NIC bandwidth (``pipette.comm.channel_links``; None: one link's speed). NCCL
    #: runs one ring per NIC, so a data-parallel group with k members on a node crosses the node
    #: cut on k NICs at once (NCCL's multi-ring all-gather/reduce-scatter; Jeaugey, "Massively
    #: scale your deep learning training with NCCL 2.4", NVIDIA 2019).
    dp_cut_fraction: float | None = None
    #: Bytes of memory touched per logit by the loss (forward and backward together):
    #: ``LOSS_BYTES_PER_LOGIT`` for an eager fp32 softmax + cross-entropy; a fused or chunked
    #: loss touches fewer (see ``FUSED_LOSS_BYTES_PER_LOGIT``).
    loss_bytes_per_logit: float = LOSS_BYTES_PER_LOGIT
    #: Selective recomputation as per-op checkpointing (0: Korthikanti's selective mode, which
    #: re-runs the attention core only): the share of the linear layers' forward recomputed,
    #: with every elementwise op, while the fused attention's output is saved. torchtitan's op
    #: mode saves the output of every other matmul (torchtitan, models/llama3/infra/parallelize.py,
    #: ``_apply_ac``: ``_save_list`` and the matmul counter), so it recomputes half of them.
    op_sac_linear_share: float = 0.0
    #: FP8 linear layers (the stack's ``fp8`` option: Transformer Engine, torchao Float8): the
    #: forward and both backward GEMMs of every linear layer at the device's ``fp8`` peak, the
    #: attention, the LM head and LoRA adapters in the training dtype (both libraries keep them
    #: there). A device without an ``fp8`` peak runs them in the training dtype.
    fp8_gemms: bool = False
    #: Achieved FP8 GEMM throughput relative to the bf16 curve at the same kernel duration
    #: (fitted: tests/benchmarks/stack_fit.py).
    fp8_efficiency: float = 1.0
    #: The FP8 casts fused away (no cast passes): Transformer Engine casts a linear layer's input
    #: inside the kernel before it (LayerNormLinear, LayerNormMLP: the norm and the activation write
    #: FP8), and with FP8 weights (NeMo's ``fp8_params``) the weights need no cast. Megatron-LM /
    #: NeMo under ``--fp8`` run on Transformer Engine; torchao Float8 (torchtitan) casts apart.
    fp8_casts_fused: bool = False
    #: Share of a micro-batch's linear-layer GEMM time under which the tensor-parallel collectives
    #: run (0: all exposed, as vTrain's and Ultra-Scale's runs had them). Transformer Engine's
    #: userbuffer overlap (Megatron-LM ``--tp-comm-overlap``, NeMo ``ub_tp_comm_overlap``; MLPerf's
    #: Llama-2-70B LoRA reference sets TP_COMM_OVERLAP with MC_TP_OVERLAP_AG/RS) splits each
    #: sequence-parallel all-gather and reduce-scatter into chunks pipelined with the GEMM that
    #: consumes or produces them: only what the GEMMs do not cover is exposed.
    tp_overlap: float = 0.0
    #: Sequence parallelism over the elementwise work: the norms, residual adds and the FP8 casts of
    #: the linear layers' inputs run on the 1/t sequence shard of each tensor-parallel rank
    #: (torchtitan's TP plan: ``SequenceParallel()`` on attention_norm and ffn_norm, the residual
    #: stream ``Shard(1)`` between blocks, and ``Float8ColwiseParallel`` casting the input shard to
    #: FP8 before the all-gather: torchtitan models/llama3/infra/parallelize.py, ``apply_tp``).
    #: False: the passes are replicated on every TP rank (Megatron-LM without sequence parallelism,
    #: as vTrain ran; Korthikanti et al. 2022, sec. 4.2.2) and each rank casts its whole input.
    sequence_parallel: bool = False
    #: Fixed cost of one pipeline p2p transfer (None: ``collective_overhead_s``, as a blocking
    #: collective). ``torch.distributed.pipelining`` posts its sends and receives as non-blocking
    #: p2p ops (``batch_isend_irecv``); a receive's wait is the schedule's data dependency, which
    #: the 1F1B formula already prices.
    p2p_overhead_s: float | None = None
    #: Whether an interleaved schedule posts each pipeline hop beside the next chunk's compute and waits
    #: for it only before that chunk's input is used (Megatron-Core's ``overlap_p2p_comm``: Megatron-LM's
    #: default where there are virtual stages, ``--no-overlap-p2p-communication`` to turn it off, and off
    #: without them, arguments.py ``validate_args``; Megatron-Bridge's ``CommOverlapConfig`` sets it
    #: whenever vp > 1). The warmup and flush still wait on their hops (``overlap_p2p_comm_warmup_flush``
    #: is off by default): ``perf._pp_time``.
    overlap_p2p_comm: bool = False
    #: Share of the 1F1B bubble (``(p-1)/(m+p-1)`` of the pipeline's time; Narayanan et al. 2021,
    #: sec. 2.2) that costs wall time. 1: each stage on a device of its own. Below 1 where ranks
    #: share cores (CPU workers): a stage waiting in the bubble blocks in its receive and leaves
    #: its core to the stages that compute.
    bubble_share: float = 1.0
    #: Fixed cost on the critical path of one FSDP2 per-unit collective (``_unit_collectives``: a
    #: gather or gradient reduction of one unit, each decoder layer and the stage's root, over the
    #: stage's data-parallel group; none when it is one rank). Apart from ``collective_overhead_s``:
    #: FSDP2 issues them asynchronously and prefetches the next unit's gather under the current
    #: unit's compute, where a tensor-parallel all-reduce blocks. 0: priced by bytes only.
    unit_collective_s: float = 0.0
    #: Memory pressure near capacity (None: off, as on every stack unless ``megatron+alloc-pressure``
    #: is named): see ``MemoryPressure``.
    memory_pressure: MemoryPressure | None = None
    #: The device peak ``fp8_gemms`` runs the linear layers at: ``fp8`` (per-tensor and blockwise MXFP8
    #: recipes) or ``fp4`` (NVFP4: Transformer Engine's ``NVFP4BlockScaling`` recipe).
    low_precision_peak: str = "fp8"
    #: LoRA's adapter GEMMs (``T x in`` by ``in x r``, r of 8-64) priced on the roofline: the longer of
    #: their FLOPs at the curve's large-GEMM efficiency and the bytes they read and write at the memory
    #: bandwidth (Williams et al. 2009). False: at the curve's efficiency for their FLOPs, which the
    #: curves (fitted on square-ish GEMMs) put at 2-3% of the peak for a rank-16 adapter.
    thin_gemm_roofline: bool = False
    #: The GEMM curve from the device family's measured kernel timings (``pipette.efficiency.kernel_curve``)
    #: before the constants' fitted ``curves``: a device the probe has not measured starts from its kernels.
    kernel_tables_first: bool = False
    #: The fused attention at the rates cuDNN's attention benchmarks measured on the device's chip
    #: (``pipette.efficiency.kernel_attention``: cudnn-frontend's sdpa_benchmark_training, forward and
    #: backward), where one was timed, instead of the GEMM curve: Transformer Engine's fused attention,
    #: which Megatron-Core runs, is cuDNN's. The timings carry what a data-sheet peak does not, such as
    #: Blackwell Ultra's doubled softmax exponential rate (GB300: 1.18x GB200's forward at equal peaks).
    measured_attention: bool = False
    #: The fused attention at FlashAttention-2's measured causal rates by sequence and head size
    #: (``pipette.efficiency.flash_attention_rate``: its README's H100 and A100 benchmarks and SDPA's
    #: flash backend on a B200, forward and backward), where neither cuDNN's rates (``measured_attention``)
    #: nor an ``attention_efficiency`` apply: what PyTorch's SDPA runs (its flash backend) under Hugging
    #: Face's models. Without it the attention is priced on the GEMM curve, which the kernel never reaches.
    flash_attention_rates: bool = False
    #: The sustained tensor-core rate of a GPU over its data-sheet peak, by a token of the GPU's name
    #: (``("GB300", 1.3)``): every GEMM's peak is scaled by it, the measured attention is not. 1 where
    #: none is given (and for the reference GPU the curve was fitted on). Fitted, per GPU, on the
    #: stack's runs (``pipette.constant_sources``): equal data-sheet peaks do not run equally fast.
    tensor_rate_shares: tuple[tuple[str, float], ...] = ()
    #: A pipeline hop carries the sequence-parallel shard (``[s/t, b, h]`` per tensor-parallel rank):
    #: Megatron-Core sends the stage's output as it is under ``--sequence-parallel``
    #: (megatron/core/pipeline_parallel/schedules.py, ``get_tensor_shapes``: seq_length // tp when
    #: sequence_parallel). False: every rank sends the whole activation.
    p2p_sequence_sharded: bool = False
    #: How context parallelism exchanges keys and values (``pipette.memory_cp.CP_COMMS``; priced by
    #: ``pipette.perf_cp``): ``p2p`` the ring of KV blocks, ``allgather`` torchtitan's rotation, ``a2a`` Ulysses
    cp_comm: str = "p2p"
    #: Share of a ring step's attention block that hides its KV transfer (``pipette.perf_cp``): 1 when the
    #: transfer runs on its own stream beside the block (Transformer Engine, PyTorch's ring)
    cp_overlap: float = 1.0
    #: The ring carries K and V repeated to every query head (torchtitan's Llama repeats them before
    #: ``F.scaled_dot_product_attention``: models/llama/model.py, ``repeat_kv``); False: the key/value heads
    cp_repeat_kv: bool = False
    #: Share of PyTorch's ring passes beside its kernels (``pipette.perf_cp.ring_compute``: the fp32 merges
    #: and accumulations) left: 1 eager; a stack's compile scales it as its elementwise passes
    #: (torchtitan compiles each block with ``fullgraph=True``, the ring inside it: Inductor fuses them)
    ring_pass_share: float = 1.0
    #: The attention keeps to each packed document (``TrainingSpec.document_len``): variable-length
    #: kernels over the documents' boundaries (Megatron-Core's THD format, ``PackedSeqParams`` with
    #: ``cu_seqlens``, which Megatron-Bridge's fine-tuning recipes run with ``packed_sequence=True``).
    #: False: the attention runs over the whole sequence, documents or not
    varlen_attention: bool = False
    #: The Mixture-of-Experts terms (``pipette.perf_moe``: grouped GEMMs, all-to-all, router imbalance)
    moe: MoeConstants = DEFAULT_MOE


@dataclass(frozen=True)
class MemoryPressure:
    """A stall per micro-batch as the estimated peak nears the device's capacity.

    PyTorch's caching allocator, when a ``cudaMalloc`` fails, frees every cached block it does not
    use and retries (``torch.cuda.memory_stats``: ``num_alloc_retries``, "number of failed cudaMalloc
    calls that result in a cache flush and retry"; the CUDA semantics notes, "Memory management").
    ``cudaFree`` synchronises the device, and the freed blocks are allocated again at the next
    micro-batch, so a run whose working set does not fit its cache pays the flush, the device sync
    and the re-allocation at every micro-batch, and a pipeline stalls with its slowest stage. The
    share of micro-batches that hit it rises as the peak nears capacity; priced linearly:

        stall = stall_s * clip((peak / capacity - onset) / (1 - onset), 0, 1)

    added to each stage's micro-batch time (``(m + p - 1) * stall`` on a 1F1B pipeline). ``peak`` is
    ``pipette.memory.estimate_memory`` with ``options`` (the stack's memory options). Fitted on the
    Ultra-Scale set (``tests/benchmarks/pressure_fit.py``, docs/stacks.md).
    """

    stall_s: float
    onset: float
    options: MemoryOptions

    def stall(self, peak_bytes: float, capacity_bytes: float) -> float:
        """Seconds per micro-batch at ``peak_bytes`` of ``capacity_bytes``."""
        if self.stall_s <= 0 or capacity_bytes <= 0 or self.onset >= 1.0:
            return 0.0
        share = (peak_bytes / capacity_bytes - self.onset) / (1.0 - self.onset)
        return self.stall_s * min(max(share, 0.0), 1.0)


#: The constants above: Megatron-LM (vTrain) and nanotron (Ultra-Scale) runs, fused kernels; LoRA's
#: adapters on the roofline (no LoRA run in those sets; Megatron-Bridge's LoRA runs check it).
#: The MoE terms are the Megatron-Bridge / SimuMax fit (``pipette.perf_moe.MEGATRON_MOE``).
MEGATRON_CONSTANTS = PerfConstants(thin_gemm_roofline=True, moe=MEGATRON_MOE, overlap_p2p_comm=True)

# ---- Pipette's own stack: Hugging Face Llama under DeepSpeed (workers.rank.train) -------------
# What Pipette's trials and launch files run: HF's eager Llama (RMSNorm upcast to fp32,
# rotary, SiLU and gating as separate kernels), PyTorch SDPA (FlashAttention-2), DeepSpeed's
# engine. Fitted (least squares on log(predicted / measured)) on the 9 timed runs of
# h100_single_gpu.csv (one H100, llama3.2-1b full and LoRA, llama3.2-3b LoRA, seq 2048-4096)
# with the H100's measured GEMM curve and the attention at FlashAttention-2's measured rates:
# tests/benchmarks/crossval.py --problem pipette --fit-all (2026-12-06; docs/results.md).
#: memory passes over T x h per layer forward (norms in fp32, residuals, rotary, casts)
HF_ELEMENTWISE_PASSES = 32.8
#: memory passes over T x f per layer forward (SiLU, the gate product)
HF_FFN_PASSES = 17.2
#: fixed time per layer per forward-equivalent pass (kernel launches of ~40 small ops, Python)
HF_LAYER_OVERHEAD_S = 7.99e-4
HF_DEEPSPEED_CONSTANTS = PerfConstants(
    elementwise_passes=HF_ELEMENTWISE_PASSES, ffn_passes=HF_FFN_PASSES, layer_overhead_s=HF_LAYER_OVERHEAD_S,
    flash_attention=True, flash_attention_rates=True,
    curves=(("h100", EfficiencyCurve(1.0, 1.0, 1.0, H100_MEASURED_BF16)),),
)
#: What Pipette predicts by default: the stack its trials and launch files run. The calibration
#: sets of other frameworks are evaluated with their own constants (MEGATRON_CONSTANTS).
DEFAULT_CONSTANTS = HF_DEEPSPEED_CONSTANTS
