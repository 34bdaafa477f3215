"""What a framework does that the memory estimate depends on (``MemoryOptions``), each stack's
options, and the estimator's planning and calibration constants.

Data only, below ``pipette.stacks`` (which bundles one set of options per stack) and
``pipette.memory`` (which estimates with a stack's options): the estimator takes a stack by name
without the stacks importing the estimator back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipette.errors import SpecError

GiB = 1024**3
FP32_BYTES = 4

# ---- planning margin ---------------------------------------------------------------
#: The plan's hard cut before the chance to fit (``peak x (1 + margin) <= capacity``), chosen on
#: the Ultra-Scale H100 set (the largest margin keeping >= 98% of the runs that succeeded). The
#: plan now uses the chance to fit (``pipette.fits``); tests/benchmarks/memory_accuracy.py still
#: reports this cut beside it for comparison (docs/results.md, "Peak memory and fits").
SAFETY_MARGIN = 0.10

# ---- framework defaults (documented options, not fitted) -----------------------------
#: Flash attention (and PyTorch SDPA) never stores the a*s^2 score matrix: nanotron,
#: DeepSpeed with HF SDPA and Megatron with flash all run it.
FLASH_ATTENTION = True
#: Tensor parallelism with sequence parallelism (Korthikanti sec. 4.2.2; nanotron's
#: REDUCE_SCATTER mode, Megatron's --sequence-parallel): the norm and residual activations
#: are sharded by t too.
SEQUENCE_PARALLEL = True
#: Gradients held in the training dtype (PyTorch autograd, DeepSpeed ZeRO with fp16).
#: Some frameworks keep fp32 gradient accumulation buffers instead (nanotron's
#: ``accumulate_grad_in_fp32``, DeepSpeed's BF16_Optimizer, Megatron's
#: ``--accumulate-allreduce-grads-in-fp32``): set ``MemoryOptions.grad_accum_fp32``.
GRAD_ACCUM_FP32 = False
#: DeepSpeed's default ``allreduce_bucket_size`` / ``reduce_bucket_size`` (elements): the
#: flat gradient bucket that is all-reduced (ZeRO-0) or reduce-scattered (ZeRO-1/2/3).
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
#: DeepSpeed ZeRO-3 defaults (elements): ``stage3_prefetch_bucket_size`` and
#: ``stage3_max_live_parameters``, which bound the gathered (live) parameters.
ZERO3_PREFETCH_ELEMENTS = 50_000_000
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
#: fp32 copies of the logits alive at the loss's peak (its backward), beside the logits in the
#: training dtype. Pipette's runner (``workers.rank.pipe_model.lm_loss``: cross-entropy over the
#: logits cast to fp32): the saved fp32 log-softmax, the fp32 gradient arriving from the loss
#: and the fp32 gradient log-softmax writes: 3 (h100_single_gpu.csv agrees: 13-14 bytes per
#: logit at bf16 between runs that differ only in micro-batch). Megatron's and nanotron's
#: vocab-parallel cross entropy store the fp32 softmax and write one fp32 gradient: 2.
LOSS_FP32_COPIES = 3
#: DeepSpeed's bf16 training without ZeRO partitioning (``BF16_Optimizer``) accumulates the
#: gradients in fp32 and releases the bf16 ones: 4 bytes per trainable parameter at the peak
#: (h100_single_gpu.csv: llama3.2-1b full fine-tuning holds 18 bytes per parameter besides the
#: activations: bf16 weights 2, fp32 gradients 4, fp32 master and Adam moments 12).
DEEPSPEED_BF16_FP32_GRADS = True

# ---- calibration constants ------------------------------------------------------------
#: Bytes on every GPU rank outside model state and activations that the caching allocator
#: sees (cuBLAS workspaces, small buffers). Fitted (least squares on the relative error,
#: 1129 runs with tp <= 8) on the Ultra-Scale H100 set (nanotron, H100 80GB);
#: tests/benchmarks/memory_accuracy.py --fit prints 0.143 GiB.
GPU_OVERHEAD_BYTES = int(0.143 * GiB)
#: Multiplier on the transient memory (activations, logits): the caching allocator's
#: fragmentation and the short-lived tensors of the backward pass (gradients of the
#: activations, fp32 upcasts). Fitted with GPU_OVERHEAD_BYTES on the same rows: 1.237.
FRAGMENTATION = 1.237
#: ``FRAGMENTATION`` for the fsdp stack, whose GPU set (torchtitan) measures the caching allocator's
#: peak *reserved* bytes: fitted (tests/benchmarks/stack_fit.py, the least MAPE) on torchtitan's two
#: eager bf16 8B rows (8 and 128 H100s, per-op SAC), with FSDP_OPTIONS' other terms counted.
FSDP_FRAGMENTATION = 1.012
#: The same under ``fsdp+compile`` (compiled blocks: the recomputed layer's elementwise
#: intermediates fused, fewer short-lived tensors), fitted on torchtitan's two compiled 8B rows on 8
#: H100s (bf16 and Float8); held out: its other 8 compiled rows (docs/stacks.md). Below 1: compile
#: saves more transient memory than the eager count leaves out.
FSDP_COMPILE_FRAGMENTATION = 0.943
#: ``MemoryOptions.dp_bucket_elements`` of a framework whose DDP buckets copy every gradient
#: (PyTorch DDP without ``gradient_as_bucket_view``): more than any model's parameters.
EVERY_GRADIENT = 10**15
#: ``FRAGMENTATION`` for the nanotron stack (``NANOTRON_OPTIONS``): fitted by
#: tests/benchmarks/memory_accuracy.py --fit on the Ultra-Scale rows of the (model, nodes) groups it
#: fits on (the split of tests/benchmarks/pressure_fit.py), checked on the others (docs/stacks.md).
NANOTRON_FRAGMENTATION = 1.31
#: ``FRAGMENTATION`` for the megatron stack: fitted by least sd of log(peak reserved / estimate) on
#: SimuMax's 24 Megatron-LM runs with both figures (simumax_b200_megatron.csv), at its bound 1.0 (sd 0.038;
#: 0.040 at nanotron's 1.237, which it carried before): their reserved bytes stand 3-7% above the
#: allocated ones whatever the activations' share of the peak (Spearman 0.10), a share of the whole
#: (``MEGATRON_RESERVED_SHARE``), not a multiplier on the activations. At 1.237, Megatron-Bridge's 405B
#: layouts on GB200 (132 GiB of activations in flight) would need 31 GiB more than their device has,
#: and they ran.
MEGATRON_FRAGMENTATION = 1.0
#: ``MemoryOptions.reserved_share`` of the megatron stack: the geometric mean of SimuMax's peak reserved
#: over the estimate's live bytes, less 1, on the same 24 runs (``tests/benchmarks/fits_boundary.py --fit``
#: prints it; the live estimate's own error on their allocated bytes: +0.4% in log)
MEGATRON_RESERVED_SHARE = 0.044
#: One CPU worker process (device_kind "cpu"): the Python interpreter, PyTorch and the gloo
#: process group resident in RAM before the model is built. A documented planning figure,
#: not fitted (no CPU measurements in the calibration sets).
CPU_PROCESS_OVERHEAD_BYTES = int(0.5 * GiB)

DEVICE_KINDS: tuple[str, ...] = ("gpu", "cpu")

# ---- outside the caching allocator (the device-used figure, ``MemoryEstimate.device_used_bytes``) ----
#: The CUDA context, cuBLAS/cuDNN workspaces and loaded kernels of one GPU rank: measured as nvidia-smi's
#: used bytes less the allocator's reserve, 1.68 GiB in every run of results/h100-2026-11-27 that ran
#: (one H100, torch 2.11, CUDA 13: no NCCL communicator; 1.61 at an OOM), 1.675-1.677 GiB on the H200 of
#: results/h200-2026-11-27
CUDA_CONTEXT_BYTES = int(1.68 * GiB)
#: NCCL's buffer per channel and peer connection: ``NCCL_BUFFSIZE``'s documented default, 4 MiB
#: (NCCL User Guide, "Environment Variables": NCCL_BUFFSIZE, default 4194304)
NCCL_BUFFSIZE_BYTES = 4 * 1024**2
#: Channels of one communicator and connections per channel (a ring's previous and next rank): a planning
#: figure, not measured (``NCCL_MAX_NCHANNELS`` allows up to 32; NVLink rings of 8 GPUs run 16 or more)
NCCL_CHANNELS = 16
NCCL_PEERS_PER_CHANNEL = 2


#: The ways ``MemoryOptions.stage_balance`` splits the layers over the pipeline stages.
STAGE_BALANCES = ("uniform", "compute", "embedding_loss")


@dataclass(frozen=True)
class MemoryOptions:
    """Framework behaviour the estimate depends on; the defaults are DeepSpeed's.

    ``shard_master_weights``: ZeRO-1 shards the fp32 master copy with the other optimizer
    states (Rajbhandari et al. 2020; DeepSpeed). nanotron keeps it unsharded, next to its
    fp32 gradient buffers. ``dp_bucket_elements``: gradient elements in ZeRO-0's all-reduce
    buckets at once (PyTorch DDP without ``gradient_as_bucket_view`` copies every gradient:
    give the parameter count or more); ``zero_bucket_elements`` the same for ZeRO-1/2/3.
    ``stage_layers`` overrides the layers per pipeline stage (DeepSpeed's uniform split by
    default), for frameworks that balance stages another way. ``loss_fp32_copies`` and
    ``deepspeed_bf16_fp32_grads``: see the constants of the same names.
    """

    flash_attention: bool = FLASH_ATTENTION
    sequence_parallel: bool = SEQUENCE_PARALLEL
    grad_accum_fp32: bool = GRAD_ACCUM_FP32
    shard_master_weights: bool = True
    dp_bucket_elements: int = DEEPSPEED_BUCKET_ELEMENTS
    zero_bucket_elements: int = DEEPSPEED_BUCKET_ELEMENTS
    stage_layers: tuple[int, ...] | None = None
    loss_fp32_copies: int = LOSS_FP32_COPIES
    deepspeed_bf16_fp32_grads: bool = DEEPSPEED_BF16_FP32_GRADS
    #: bf16 training keeps its gradient buffer in fp32 at every ZeRO stage, unsharded by the
    #: distributed optimizer: Megatron-LM turns ``accumulate_allreduce_grads_in_fp32`` on under
    #: ``--bf16`` unless ``--grad-reduce-in-bf16`` (megatron/training/arguments.py), and the grad
    #: buffer takes that dtype (megatron/core/distributed/param_and_grad_buffer.py): 6 + 12/d bytes
    #: per parameter with the distributed optimizer (Megatron-LM's docs, "Distributed Optimizer").
    #: fp16 keeps fp16 gradients.
    bf16_fp32_grads: bool = False
    #: DeepSpeed's ZeRO-1/2 optimizer and engine as Pipette's ``ds_config.json`` runs them
    #: (``pipette.emit.deepspeed_config``: ``overlap_comm``, ``contiguous_gradients``, ``reduce_bucket_size``
    #: the whole model's trainable parameters), read from deepspeed/runtime/zero/stage_1_and_2.py (0.19.8):
    #: the fp32 master partition is a clone even when the weights are fp32 (``single_partition_of_fp32_groups``:
    #: ``.detach().clone()``; ZeRO-3 reuses an fp32 partition); two ``reduce_bucket_size`` buffers through the
    #: backward, at any dp (``setup_buckets``: "double buffers ... when overlap_comm is enabled"), one under
    #: the pipeline engine (``reduce_gradients(pipeline_parallel=True)``); ZeRO-0's flat all-reduce copy
    #: only after the backward (engine.py ``buffered_allreduce_fallback``), when the activations are freed.
    #: Measured on CPU ranks: docs/results.md, "The DeepSpeed runner's ZeRO buffers on CPU".
    deepspeed_zero: bool = False
    #: FSDP2's sharding (``fully_shard`` per decoder layer, then the stage: ``_fsdp2_state``)
    #: instead of DeepSpeed's ZeRO; ``zero_stage`` 3/2/0 is FULL_SHARD / no reshard / NO_SHARD
    fsdp2: bool = False
    #: The linear layers' weights held in FP8, 1 byte each (NeMo's ``fp8_params``, Transformer
    #: Engine's Float8Tensor parameters; MLPerf's Llama-2-70B LoRA reference sets it with ``FP8``:
    #: mlcommons/training_results_v4.0, NVIDIA llama2_70b_lora, megatron_gpt_peft_tuning_config.yaml).
    #: Embedding, head and norms stay in the training dtype.
    fp8_weights: bool = False
    #: Whether a frozen linear layer's input is kept for the backward. Only the weight gradient
    #: needs it, so Transformer Engine keeps it only when ``weight.requires_grad``
    #: (transformer_engine/pytorch/ops/basic/basic_linear.py, ``weight_requires_grad``): under
    #: LoRA (llama) the MLP norm's output and the down projection's input are not stored unless
    #: an adapter reads them. True (kept) for Pipette's runner: its fits prior
    #: (``pipette.fits.PIPETTE_GPU``) was fitted on the estimate with them.
    frozen_inputs_saved: bool = True
    #: Selective recomputation as torchtitan's per-op checkpointing (``selective_ac_option = "op"``):
    #: each layer keeps its input and the outputs of the ops in ``_save_list`` (every other mm,
    #: the SDPA kernel's output) and recomputes the rest in the backward (torchtitan,
    #: models/llama3/infra/parallelize.py, ``_apply_ac_to_transformer_block``: "Saves output of all
    #: compute ops, except every second mm"). False: Korthikanti's selective (scores only).
    op_sac: bool = False
    #: A fused cross-entropy: the fp32 upcast, log-softmax and NLL in one kernel each way, so no fp32
    #: copy of the logits is materialized; it keeps the logits (d bytes) and writes their gradient
    #: (d). torchtitan under compile (``build_cross_entropy_loss`` wraps ``cross_entropy_loss`` in
    #: ``torch.compile``: torchtitan/components/loss.py; before 2025 its train.py left it eager,
    #: "TODO: compiling loss function causes CUDA errors"); llm-foundry's MPT by default
    #: (``loss_fn`` ``fused_crossentropy``: flash-attn's ``CrossEntropyLoss``, llmfoundry/models/mpt).
    fused_loss: bool = False
    #: Tensor parallelism as PyTorch DTensor runs it (torchtitan's ``ColwiseParallel`` with
    #: ``input_layouts=Shard(1)`` on wq/wk/wv, w1/w3 and the output projection): the norm's output is
    #: all-gathered over the sequence and ``F.linear`` saves that gathered input for its weight
    #: gradient, so each of the two norm outputs of a layer and the final norm's are held whole, not
    #: 1/t. Megatron's sequence parallelism saves the 1/t shard and re-gathers it in the backward
    #: (Korthikanti et al. 2022, sec. 4.2.2): False.
    tp_saves_gathered_inputs: bool = False
    #: The embedding's weight gradient made whole before it is cut to the rank's rows, under tensor
    #: parallelism with sequence parallelism as DTensor runs it (torchtitan's ``RowwiseParallel``
    #: embedding with ``output_layouts=Shard(1)``): the gradient arrives split over the sequence, so
    #: ``embedding_dense_backward`` sums this rank's tokens into a ``Partial`` gradient of the whole
    #: vocabulary (d bytes, V x h) that a reduce-scatter then cuts to 1/t (traced: Llama 3 70B tp8,
    #: 1.96 GiB where the rank keeps 0.25; docs/results.md, "Traced memory"). Megatron gathers the
    #: sequence first and makes only its vocabulary rows' gradient: False.
    tp_embedding_grad_whole: bool = False
    #: fp32 copies of the logits at the loss's peak under tensor parallelism where the stack then
    #: runs a vocab-parallel loss of its own (None: ``loss_fp32_copies``). torchtitan turns on
    #: PyTorch's ``loss_parallel`` with TP (``enable_loss_parallel``, default true); its backward
    #: (torch/distributed/tensor/parallel/loss.py, ``_nll_loss_and_log_softmax_backward``:
    #: ``(zeros_like(x) scattered + exp(x)) * grad_output``) holds the saved log-softmax output and
    #: its temporaries: 4, where the eager kernels hold 3 (traced on the runner, Llama 3 8B tp2:
    #: docs/results.md, "Traced memory").
    tp_loss_fp32_copies: int | None = None
    #: Multiplier on the transient memory (activations, logits): the caching allocator's
    #: fragmentation and short-lived tensors (``FRAGMENTATION``, fitted on nanotron's figures); a
    #: stack whose sets measure reserved memory fits its own.
    fragmentation: float = FRAGMENTATION
    #: The caching allocator's reserve beyond the live tensors as a share of them (reserved = live x
    #: (1 + share)), where a stack's runs show a gap flat in the peak's make-up (``MEGATRON_RESERVED_SHARE``)
    reserved_share: float = 0.0
    #: How the layers are split over the pipeline stages where ``stage_layers`` does not say:
    #: "uniform" (DeepSpeed's and Megatron-LM's even split, heaviest first), "compute"
    #: (nanotron's: ``compute_balanced_stage_layers``) or "embedding_loss" (Megatron-Core's
    #: ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` where the
    #: layers alone do not split evenly: ``embedding_loss_stage_layers``).
    stage_balance: str = "uniform"
    #: Megatron-Core's fused SwiGLU (``bias_activation_fusion``: ``bias_swiglu_impl``, on by default in
    #: Megatron-LM, ``--no-bias-swiglu-fusion`` turns it off; megatron/core/fusions/fused_bias_swiglu.py
    #: saves the fc1 output only and recomputes the SiLU in the backward): no SiLU output is stored
    fused_swiglu: bool = False
    #: What a per-head q/k RMSNorm (Qwen3's attention) keeps (``pipette.memory.qk_norm_bytes``): "eager"
    #: (Hugging Face's ``Qwen3RMSNorm``: its fp32-cast input and its normalized output) or "te" (Transformer
    #: Engine's fused norm, Megatron-Core's ``qk_layernorm``: its input)
    qk_norm: Literal["eager", "te"] = "eager"
    #: Bytes per element of a linear layer's input kept for its weight gradient where the stack keeps
    #: it quantized (None: the training dtype). Transformer Engine's FP8/MXFP8/NVFP4 linears save the
    #: input as their quantizer cast it (transformer_engine/pytorch/module/linear.py and
    #: layernorm_linear.py: ``inputmat`` / ``ln_out`` saved as the quantized tensor, column-wise usage
    #: only, for the wgrad GEMM): the attention's and the MLP's norm outputs and the down projection's
    #: input; the output projection's input is saved quantized beside the attention's own bf16 output.
    #: Full training of a dense Llama only (a LoRA adapter reads the same input in bf16).
    linear_input_bytes: float | None = None
    #: The figure the stack's capacity check compares (``pipette.estimates.CAPACITY_FIGURES``, reserved or
    #: device-used): the one its
    #: fits prior was fitted on. Pipette's runner's prior (``pipette.fits.PIPETTE_GPU``) was fitted on the
    #: device's used bytes (the allocator's reserve + what lies outside it); the other stacks' sets measured
    #: the allocator's reserve only
    capacity_figure: str = "reserved"
    #: How context parallelism exchanges the keys and values (``pipette.memory_cp.CP_COMMS``): what
    #: a cp rank holds in flight during a layer's attention (``memory_cp.exchange_bytes``)
    cp_comm: str = "p2p"
    #: Whether K and V reach the cp exchange repeated to every query head (torchtitan's Llama runs
    #: ``repeat_kv`` before ``F.scaled_dot_product_attention``, as Pipette's runner does on CUDA:
    #: ``workers.rank.context_parallel.torch_ring_attention``); as ``PerfConstants.cp_repeat_kv``
    cp_repeat_kv: bool = False
    #: ``cp_comm`` on CPU ranks where the stack's runner exchanges otherwise there (None: ``cp_comm``; the
    #: fsdp stack's runner rings KV blocks point to point on CPUs, ``workers.rank.ring_attention``, as
    #: ``FSDP_CPU_CONSTANTS`` prices it), and never with K and V repeated
    cpu_cp_comm: str | None = None
    #: Megatron-Core's selective recomputation modules a recipe names (``recompute_modules``; its
    #: ``recompute_granularity = "selective"``): ``mla_up_proj`` (MLA's up-projected q, k and v are dropped
    #: once the core attention has run and rebuilt for the backward: ``qkv_up_checkpoint``), ``moe_act``
    #: (the routed experts' activation output: ``activation_checkpoint``), ``mlp`` (the whole MLP or MoE
    #: layer rebuilt from its input: megatron/core/transformer/transformer_layer.py, ``recompute_mlp``)
    recompute_modules: tuple[str, ...] = ()
    #: Bytes per parameter of Adam's two moments where a recipe runs Megatron-Core's precision-aware
    #: optimizer (``use_precision_aware_optimizer`` with ``exp_avg_dtype`` / ``exp_avg_sq_dtype``; None: two
    #: fp32 moments, 8). Megatron-Bridge's DeepSeek-V3 recipe keeps both in bf16: 4.
    optimizer_moment_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_figure not in ("reserved", "device-used"):
            raise SpecError(f"unknown capacity_figure {self.capacity_figure!r}", field="options.capacity_figure",
                            fix="use reserved or device-used (the figures a prior is fitted on)")
        if self.stage_balance not in STAGE_BALANCES:
            raise SpecError(f"unknown stage_balance {self.stage_balance!r}", field="options.stage_balance",
                            fix=f"use one of {', '.join(STAGE_BALANCES)}")

    def cp_exchange(self, device_kind: str) -> tuple[str, bool]:
        """How a cp rank on ``device_kind`` exchanges K and V: the comm and whether they are repeated
        to the query heads (``memory_cp.exchange_bytes``)."""
        if device_kind == "cpu" and self.cpu_cp_comm is not None:
            return self.cpu_cp_comm, False
        return self.cp_comm, self.cp_repeat_kv and device_kind == "gpu"


DEFAULT_OPTIONS = MemoryOptions(capacity_figure="device-used", deepspeed_zero=True)
#: Megatron-LM's loss (vocab-parallel cross entropy), no DeepSpeed BF16_Optimizer, Transformer
#: Engine's frozen linear inputs not kept, its fp32 gradient buffer under bf16, its fused SwiGLU, and
#: the embedding and loss counted as pipeline layers where the layers alone do not split: the megatron stack.
MEGATRON_OPTIONS = MemoryOptions(loss_fp32_copies=2, deepspeed_bf16_fp32_grads=False, frozen_inputs_saved=False,
                                 bf16_fp32_grads=True, fused_swiglu=True, qk_norm="te", stage_balance="embedding_loss",
                                 fragmentation=MEGATRON_FRAGMENTATION, reserved_share=MEGATRON_RESERVED_SHARE)
#: Bytes per element of a linear input Transformer Engine saves under each low-precision recipe
#: (``MemoryOptions.linear_input_bytes``): FP8 1; MXFP8 1 and one E8M0 scale per 32 elements; NVFP4
#: 4 bits and one E4M3 scale per 16 elements (TE's ``MXFP8BlockScaling`` / ``NVFP4BlockScaling`` recipes)
FP8_INPUT_BYTES = 1.0
MXFP8_INPUT_BYTES = 1.0 + 1.0 / 32
NVFP4_INPUT_BYTES = 0.5 + 1.0 / 16
#: nanotron (Hugging Face's 3D-parallel trainer) as it holds a model, read from its source:
#: the fp32 gradient buffer of every parameter kept unsharded, even under ZeRO-1
#: (``accumulate_grad_in_fp32``: ``FP32GradientAccumulator`` builds "grad buffers for all model's
#: parameters, independently of ZeRO sharding", nanotron/optim/gradient_accumulator.py), the fp32
#: master copy sharded with ZeRO-1 ("fp32 and half are sharded in case of Zero", same file),
#: PyTorch DDP's buckets copying every gradient under ZeRO-0 (``EVERY_GRADIENT``: the earlier
#: description of these runs in tests/benchmarks/memory_accuracy.py, not re-read in nanotron), none
#: under ZeRO-1 (with a copy there too the error trends with dp again against the Ultra-Scale
#: runs, +0.18 in log at dp 1 to -0.16 at dp 256: docs/stacks.md), its vocab-parallel cross entropy
#: (``_ShardedCrossEntropy`` saves the fp32 softmax: 2 copies), every linear input saved whatever
#: its weight (``ctx.save_for_backward(tensor, weight)``, nanotron/parallel/tensor_parallel/
#: functional.py), only the local shard of a column-parallel input under sequence parallelism
#: (``tp_recompute_allgather``), and the stages balanced by compute cost. ``fragmentation`` is
#: nanotron's own, fitted on the Ultra-Scale set (``NANOTRON_FRAGMENTATION``).
NANOTRON_OPTIONS = MemoryOptions(loss_fp32_copies=2, deepspeed_bf16_fp32_grads=False, bf16_fp32_grads=True,
                                 shard_master_weights=True, dp_bucket_elements=EVERY_GRADIENT, zero_bucket_elements=0,
                                 stage_balance="compute", fragmentation=NANOTRON_FRAGMENTATION)
#: PyTorch FSDP2 as torchtitan and Pipette's PyTorch-native runner compose it: the model's fp32
#: parameters sharded, fp32 gradient reduction, and the loss over the logits cast to fp32
#: (torchtitan's ``cross_entropy_loss``, ``workers.rank.fsdp_model.lm_loss``: 3 fp32 copies, as
#: Pipette's DeepSpeed runner).
FSDP_OPTIONS = MemoryOptions(grad_accum_fp32=True, deepspeed_bf16_fp32_grads=False, fsdp2=True, op_sac=True,
                             tp_saves_gathered_inputs=True, tp_embedding_grad_whole=True, tp_loss_fp32_copies=4,
                             fragmentation=FSDP_FRAGMENTATION, cp_comm="allgather", cp_repeat_kv=True,
                             cpu_cp_comm="p2p")
