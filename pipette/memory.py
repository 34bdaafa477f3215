"""Peak memory per rank of one candidate, on its heaviest pipeline stage.

Pure arithmetic (no allocation, no numpy): the search calls it for every candidate.

Symbols (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4): s sequence length, b micro-batch size, h hidden size, a heads, t tensor-
parallel degree, L layers; plus d bytes per element of the training dtype, kv the width of
the k (and v) projection, f the MLP width, V the vocabulary, p pipeline degree, m
micro-batches per step, v virtual stages per device, N_d the data-parallel degree and Psi a
parameter count (Rajbhandari et al. 2020, "ZeRO", sec. 3 and Fig. 1).

Every stage is evaluated: the first holds the embedding and the most micro-batches in
flight, the last the LM head and the logits; the estimate reports the heaviest.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipette import memory_fsdp2, memory_moe
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.estimates import MemoryEstimate
from pipette.memory_cp import exchange_bytes, fold
from pipette.memory_options import (
    CPU_PROCESS_OVERHEAD_BYTES,
    CUDA_CONTEXT_BYTES,
    DEFAULT_OPTIONS,
    DEVICE_KINDS,
    FP32_BYTES,
    FRAGMENTATION,
    FSDP_COMPILE_FRAGMENTATION,
    FSDP_FRAGMENTATION,
    FSDP_OPTIONS,
    GPU_OVERHEAD_BYTES,
    MEGATRON_OPTIONS,
    NANOTRON_FRAGMENTATION,
    NANOTRON_OPTIONS,
    NCCL_BUFFSIZE_BYTES,
    NCCL_CHANNELS,
    NCCL_PEERS_PER_CHANNEL,
    SAFETY_MARGIN,
    ZERO3_MAX_LIVE_PARAMETERS,
    ZERO3_PREFETCH_ELEMENTS,
    MemoryOptions,
)
from pipette.model import ModelSpec
from pipette.stacks import Stack, get_stack
from pipette.training import TrainingSpec


def estimate_memory(
    model: ModelSpec,
    training: TrainingSpec,
    config: ParallelConfig,
    capacity_bytes: int,
    *,
    device_kind: str = "gpu",
    stack: str | Stack | None = None,
    options: MemoryOptions | None = None,
) -> MemoryEstimate:
    """Peak bytes on the heaviest rank of ``config`` (the heaviest pipeline stage), held as ``stack``
    holds a model (a name such as ``"nanotron"`` or ``"megatron+fp8"``, or a ``pipette.stacks.Stack``:
    its memory options). ``options`` estimates with those instead; neither: Pipette's runner's. An
    unknown stack is a ``SpecError`` naming the known ones."""
    if stack is not None and options is not None:
        raise SpecError("both a stack and memory options were given", field="stack",
                        fix="give the stack (its own memory options) or the options, not both")
    options = get_stack(stack).memory_options if stack is not None else (options or DEFAULT_OPTIONS)
    if capacity_bytes <= 0:
        raise SpecError(
            f"capacity must be positive, got {capacity_bytes!r}",
            field="device.memory_bytes", fix="give the device memory in bytes",
        )
    stages = stage_breakdowns(model, training, config, device_kind=device_kind, options=options, host=True)
    totals = [sum(part.values()) for part in stages]
    heaviest = max(range(len(totals)), key=totals.__getitem__)
    notes = _notes(training, config, options, device_kind)
    host = [part.pop(HOST_KEY, 0) for part in stages]
    outside = outside_allocator_bytes(config) if device_kind == "gpu" else 0
    # the figure the stack compares with the capacity (MemoryOptions.capacity_figure); live is not one a
    # prior was fitted on, so a stack naming it compares the reserve
    compared = outside if options.capacity_figure == "device-used" else 0
    return MemoryEstimate(
        peak_bytes=totals[heaviest] - host[heaviest] + compared, capacity_bytes=int(capacity_bytes),
        breakdown=stages[heaviest], stage=heaviest, notes=notes, host_bytes=max(host), outside_bytes=outside,
        capacity_figure="device-used" if compared else "reserved",
    )


def outside_allocator_bytes(config: ParallelConfig) -> int:
    """A GPU rank's bytes outside the caching allocator: the CUDA context and workspaces
    (``CUDA_CONTEXT_BYTES``, measured) and NCCL's buffers, ``NCCL_CHANNELS`` x ``NCCL_PEERS_PER_CHANNEL``
    x ``NCCL_BUFFSIZE_BYTES`` for each communicator of more than one rank it belongs to (tensor, pipeline,
    data, context and expert parallel groups)."""
    groups = sum(degree > 1 for degree in (config.tp, config.pp, config.dp, config.cp, config.ep))
    return CUDA_CONTEXT_BYTES + groups * NCCL_CHANNELS * NCCL_PEERS_PER_CHANNEL * NCCL_BUFFSIZE_BYTES


def stage_breakdowns(
    model: ModelSpec,
    training: TrainingSpec,
    config: ParallelConfig,
    *,
    device_kind: str = "gpu",
    options: MemoryOptions = DEFAULT_OPTIONS,
    host: bool = False,
    phase: str | None = None,
) -> list[dict[str, int]]:
    """The breakdown over ``MEMORY_PARTS`` of one rank of every pipeline stage, in order; with
    ``host``, the bytes FSDP2's CPU offload keeps in host memory under ``HOST_KEY`` too. Under FSDP2
    each stage's is that of its heaviest phase (``memory_fsdp2.PHASES``), or of ``phase`` where the
    stage goes through it (the loss and the head: the last stage only)."""
    if phase is not None and phase not in memory_fsdp2.PHASES:
        raise SpecError(f"unknown phase {phase!r}", field="phase", fix=f"use one of {', '.join(memory_fsdp2.PHASES)}")
    if device_kind not in DEVICE_KINDS:
        raise SpecError(
            f"unknown device kind {device_kind!r}", field="device.kind", fix="use gpu or cpu"
        )
    # a cp rank holds what a dp rank of s/cp-token sequences on dp x cp replicas holds, and the
    # attention's KV exchange in flight (pipette.memory_cp)
    cp_comm, repeat_kv = options.cp_exchange(device_kind)
    exchange = exchange_bytes(model, training, config, cp_comm, repeat_kv=repeat_kv)
    training, config = fold(training, config)
    layers = _stage_layers(model, config, options)
    nbytes = _bytes_per_param(training, config, options)
    moe = None if model.moe is None else memory_moe.stage_terms(model, training, config, layers, memory_moe.StateBytes(
        training.dtype_bytes, nbytes.grad, nbytes.state, nbytes.master, options.shard_master_weights, options.fsdp2),
        _mlp_saving(training, options))
    terms = _StageTerms(
        model, training, config, options, _params_per_rank(model, training, config, options), nbytes,
        _activations(model, training, config, options), moe, exchange, device_kind == "gpu", phase,
    )
    return [_stage(terms, i, layers_i, host) for i, layers_i in enumerate(layers)]


def _mlp_saving(training: TrainingSpec, options: MemoryOptions) -> memory_moe.MlpSaving:
    """How the stack stores an MoE model's MLPs (``memory_moe.MlpSaving``): as ``_te_layer`` the dense ones
    (quantized inputs under full training only: an adapter reads the same input in bf16)."""
    q = options.linear_input_bytes if training.lora is None else None
    return memory_moe.MlpSaving(options.fused_swiglu, q, options.recompute_modules)


def _stage_layers(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> tuple[int, ...]:
    """Decoder layers per pipeline stage: the options' own split, or ``MemoryOptions.stage_balance``'s."""
    p = config.pp
    layers = options.stage_layers or _balanced_stage_layers(model, config, options.stage_balance)
    if len(layers) != p or sum(layers) != model.layers:
        raise SpecError(
            f"stage_layers {list(layers)} do not split {model.layers} layers over pp={p}",
            field="options.stage_layers", fix="give pp counts that add up to the layers",
        )
    return layers


@dataclass(frozen=True)
class _ParamsPerRank:
    """Parameters (Psi) one rank holds of one decoder layer, of the embedding, of the head and of
    one layer's adapters; and the bytes FP8 weights save on one layer."""

    layer: float
    embed: float
    head: float
    lora: float
    fp8_saved: float


def _params_per_rank(
    model: ModelSpec, training: TrainingSpec, config: ParallelConfig, options: MemoryOptions
) -> _ParamsPerRank:
    """Megatron tensor parallelism (Shoeybi et al. 2019, sec. 3): every linear layer is split over t;
    norms are replicated; embedding and LM head are vocab-parallel (V/t rows). Grouped-query attention
    with t > kv_heads replicates each k/v head on t / kv_heads ranks: k and v split over min(t, kv_heads)
    only."""
    t, p, h, V, d = config.tp, config.pp, model.hidden, model.vocab, training.dtype_bytes
    t_kv = min(t, model.kv_heads)
    linear = sum(i * o for i, o in model.linear_shapes().values())
    kv_linear = memory_moe.kv_linear(model)
    layer_psi = (model.layer_params() - model.norm_params() - linear) / t  # biases (GPT)
    layer_psi += (linear - kv_linear) / t + kv_linear / t_kv + model.norm_params()
    embed_psi = model.vocab * h / t + (model.embedding_params() - model.vocab * h)
    final_norm = model.head_params() - (0 if model.tied_embeddings else V * h)
    # A tied head on another stage than the embedding keeps its own copy (Megatron, nanotron
    # and DeepSpeed's TiedLayerSpec all-reduce the two copies' gradients).
    head_psi = final_norm + (0 if model.tied_embeddings and p == 1 else V * h / t)
    # FP8 weights: each linear weight 1 byte instead of d (``MemoryOptions.fp8_weights``)
    fp8_saved = ((linear - kv_linear) / t + kv_linear / t_kv) * (d - 1) if options.fp8_weights else 0.0
    return _ParamsPerRank(layer_psi, embed_psi, head_psi, _lora_params_per_layer(model, training, t), fp8_saved)


@dataclass(frozen=True)
class _BytesPerParam:
    """Bytes per parameter of gradients, optimizer moments and master weights, the ZeRO shards of
    weights and gradients, and the optimizer's bytes per trainable parameter on one rank."""

    grad: int
    state: int
    master: int
    weight_shard: int
    grad_shard: int
    optimizer: float


def _bytes_per_param(training: TrainingSpec, config: ParallelConfig, options: MemoryOptions) -> _BytesPerParam:
    """Rajbhandari et al. 2020, sec. 3: 2 + 2 + K bytes per parameter with K = 12, sharded over N_d by
    ZeRO stage (P_os, P_os+g, P_os+g+p)."""
    d, n_d, z = training.dtype_bytes, config.dp, config.zero_stage
    mixed = training.mixed_precision
    bf16_optimizer = options.deepspeed_bf16_fp32_grads and training.dtype == "bf16" and config.zero_stage == 0
    bf16_grads = options.bf16_fp32_grads and training.dtype == "bf16"
    grad_bytes = FP32_BYTES if (options.grad_accum_fp32 or bf16_optimizer or bf16_grads or not mixed) else d
    # Adam: m and v in fp32; SGD: one momentum buffer. Mixed precision adds the fp32 master.
    state_bytes = (2 if training.optimizer in ("adam", "adamw") else 1) * FP32_BYTES
    if options.optimizer_moment_bytes is not None and training.optimizer in ("adam", "adamw"):
        state_bytes = options.optimizer_moment_bytes
    master_bytes = FP32_BYTES if mixed or (options.deepspeed_zero and z in (1, 2)) else 0
    w_shard = n_d if z >= 3 else 1  # P_os+g+p
    g_shard = n_d if z >= 2 else 1  # P_os+g
    o_shard = n_d if z >= 1 else 1  # P_os
    master_shard = o_shard if options.shard_master_weights else 1
    opt_per_psi = state_bytes / o_shard + master_bytes / master_shard
    return _BytesPerParam(grad_bytes, state_bytes, master_bytes, w_shard, g_shard, opt_per_psi)


@dataclass(frozen=True)
class _Activations:
    """Bytes of one rank's activations: kept per layer and micro-batch, rebuilt in the backward (one
    layer at a time), and the last stage's: the head's inputs and the logits with the loss."""

    per_layer: float
    rebuilt: float
    head: float
    logits: float
    #: the d-byte logits (or, in the backward, their gradient): a share of ``logits`` unless the loss is fused
    logits_d: float


def _activations(
    model: ModelSpec, training: TrainingSpec, config: ParallelConfig, options: MemoryOptions
) -> _Activations:
    """Korthikanti et al. 2022, sec. 4.1 (eq. 1-2) for one layer and one micro-batch, sec. 4.2-4.3 for
    what recomputation keeps, sec. 4.4 for the last stage (final norm, logits and loss)."""
    s, b, h, t, d = training.seq_len, config.mbs, model.hidden, config.tp, training.dtype_bytes
    act_split, act_kv, act_seq, act_scores = _layer_activations(model, s, b, d)
    if training.lora is not None and not options.frozen_inputs_saved:
        act_split, act_seq = _without_frozen_inputs(model, training, s, b, d, act_split, act_seq)
    act_split, act_seq = _te_layer(model, training, s, b, d, act_split, act_seq, options)
    if "mla_up_proj" in options.recompute_modules:
        act_split, act_kv = memory_moe.without_mla_up_proj(model, s, b, d, act_split, act_kv)
    q_norm, k_norm = qk_norm_bytes(model, s * b, d, options)
    act_split, act_kv = act_split + q_norm, act_kv + k_norm
    act_sharded = act_split / t + act_kv / min(t, model.kv_heads)
    act_seq_t = act_seq / t if options.sequence_parallel else act_seq
    # the two norm outputs a layer gathers whole under DTensor's sequence parallelism, beyond their
    # 1/t shard counted in act_seq_t (``MemoryOptions.tp_saves_gathered_inputs``)
    gathered = 0.0
    if options.tp_saves_gathered_inputs and options.sequence_parallel and t > 1:
        gathered = 2 * d * s * b * h * (1 - 1 / t)
    layer = act_sharded + act_seq_t + gathered
    per_layer, rebuilt = _kept_and_rebuilt(model, training, config, options, layer, act_scores / t)
    head_act = 2 * d * s * b * h / (t if options.sequence_parallel else 1) + gathered / 2
    copies = options.tp_loss_fp32_copies if t > 1 and options.tp_loss_fp32_copies is not None \
        else options.loss_fp32_copies
    logits = b * s * model.vocab / t * (2 * d if options.fused_loss else d + copies * FP32_BYTES)
    return _Activations(per_layer, rebuilt, head_act, logits, b * s * model.vocab / t * d)


def qk_norm_bytes(model: ModelSpec, tokens: int, d: int, options: MemoryOptions) -> tuple[float, float]:
    """Bytes the per-head q and k RMSNorms of one layer (Qwen3's attention) keep for ``tokens`` tokens, over
    q's width and k's: per element, Transformer Engine's fused norm its input (``options.qk_norm`` "te");
    Hugging Face's eager ``Qwen3RMSNorm`` its input cast to fp32 and its normalized output in the training
    dtype ("eager": max(4, d) + d bytes; an fp32 cast of fp32 is the input itself). Traced with the fsdp
    runner's Qwen3 (docs/results.md, "Traced memory"): 6 bytes per element of q and k in bf16."""
    a = model.attention
    if a is None or not a.qk_norm or a.mla is not None:
        return 0.0, 0.0
    per = float(d) if options.qk_norm == "te" else float(max(FP32_BYTES, d) + d)
    return per * tokens * model.heads * model.head_dim, per * tokens * model.kv_dim


def _kept_and_rebuilt(
    model: ModelSpec, training: TrainingSpec, config: ParallelConfig, options: MemoryOptions,
    layer: float, scores: float,
) -> tuple[float, float]:
    """(kept per layer and micro-batch, rebuilt in the backward) under the candidate's recomputation,
    from one layer's activations without the scores (``layer``) and its scores (both per rank)."""
    s, b, h, t, d = training.seq_len, config.mbs, model.hidden, config.tp, training.dtype_bytes
    if config.recompute == "full":
        # Only the layer input is kept (Korthikanti sec. 4.3: 2sbh per layer, /t with
        # sequence parallelism) ...
        per_layer = d * s * b * h / (t if options.sequence_parallel else 1)
        # ... and during the backward one layer's activations are rebuilt at a time.
        return per_layer, layer + (0 if options.flash_attention else scores)
    if config.recompute == "selective" and options.op_sac and model.arch == "llama":
        per_layer = _op_sac_saved(model, s, b, d, t, min(t, model.kv_heads), options.sequence_parallel)
        # ... and during the backward one layer's activations are rebuilt at a time
        return per_layer, layer
    # Selective recomputation drops the a*s^2 score terms (Korthikanti sec. 4.2.1,
    # eq. 7: sbh*34/t); flash attention never stores them.
    keep_scores = config.recompute == "none" and not options.flash_attention
    return layer + (scores if keep_scores else 0), 0.0


@dataclass(frozen=True)
class _StageTerms:
    """What every pipeline stage of one candidate is worked out from (its recipe and layout folded
    over cp: ``pipette.memory_cp.fold``)."""

    model: ModelSpec
    training: TrainingSpec
    config: ParallelConfig
    options: MemoryOptions
    params: _ParamsPerRank
    nbytes: _BytesPerParam
    acts: _Activations
    moe: list[dict[str, float]] | None
    exchange: float
    gpu: bool
    #: FSDP2's phase to give instead of the heaviest (``stage_breakdowns``)
    phase: str | None = None


def _held_layers(config: ParallelConfig, i: int, layers_i: int) -> float:
    """Layers' activations stage ``i`` holds at its peak. Micro-batches in flight: 1F1B stage i holds
    min(p - i, m) (Narayanan et al. 2021, sec. 2.2); the interleaved schedule holds
    (p - i - 1) * 2 + (v - 1) * p + 1 model chunks of L_i / v layers in its warm-up (Megatron-LM's
    interleaved schedule, Narayanan et al. 2021, sec. 2.2), so its first stage holds more."""
    p, m, v = config.pp, config.grad_accum, config.virtual_stages
    if v == 1:
        return min(p - i, m) * layers_i
    return min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) * layers_i / v


def _stage(c: _StageTerms, i: int, layers_i: int, host: bool) -> dict[str, int]:
    """One rank of pipeline stage ``i`` (``layers_i`` decoder layers) over ``MEMORY_PARTS``."""
    config, options, P, nb, d = c.config, c.options, c.params, c.nbytes, c.training.dtype_bytes
    p = config.pp
    trainable_full = c.training.method == "full"
    psi = layers_i * P.layer + (P.embed if i == 0 else 0) + (P.head if i == p - 1 else 0)
    trainable = psi if trainable_full else layers_i * P.lora
    frozen = 0 if trainable_full else psi
    weights = ((frozen + trainable) * d - layers_i * P.fp8_saved) / nb.weight_shard
    gradients = trainable * nb.grad / nb.grad_shard
    optimizer = trainable * nb.optimizer
    held_layers = _held_layers(config, i, layers_i)
    activations = held_layers * c.acts.per_layer + (c.acts.rebuilt if layers_i else 0)
    stage_logits = 0.0
    if i == p - 1:
        activations += c.acts.head
        stage_logits = c.acts.logits
    # DeepSpeed's buckets are the written config's size, the whole model's trainable parameters
    bucket_psi = trainable_params(c.model, c.training) if options.deepspeed_zero else trainable
    buffers = _buffers(config, bucket_psi, P.layer, nb.grad, d, options)
    offloaded, cache = 0.0, None
    if options.fsdp2:
        # FSDP2's parts are not all alive at once: the heaviest of the step's phases (pipette.memory_fsdp2)
        f, offloaded = _fsdp2_state(
            config, c.training, layers_i, P.layer + P.lora, (P.embed if i == 0 else 0) + (P.head if i == p - 1 else 0),
            psi, trainable, P.lora if not trainable_full else P.layer + P.lora, offload=config.offload and c.gpu,
        )
        transient = _fsdp2_transient(c, i, layers_i, held_layers)
        every = memory_fsdp2.phases(f, transient)
        parts = every[c.phase] if c.phase in every else every[memory_fsdp2.heaviest(every)]
        weights, gradients, optimizer = parts["weights"], parts["gradients"], parts["optimizer"]
        activations, stage_logits, buffers = parts["activations"], parts["logits"], parts["buffers"]
        cache = memory_fsdp2.reserve(f, transient)
    buffers += c.exchange if layers_i else 0.0
    if c.moe is not None:  # the MLPs of a model with experts (pipette.memory_moe)
        held_share = held_layers / layers_i if layers_i else 0.0
        mlp = c.moe[i]
        weights, gradients, optimizer = (weights + mlp["weights"], gradients + mlp["gradients"],
                                         optimizer + mlp["optimizer"])
        activations += mlp["one_layer"] if config.recompute == "full" else held_share * mlp["per_micro_batch"]
        buffers += mlp["buffers"]
    buffers += _after_backward(config, options, nb.grad, gradients, activations + stage_logits)
    live = weights + gradients + optimizer + activations + stage_logits + buffers
    if c.gpu:
        # the caching allocator's reserve over the step: under FSDP2 the blocks other phases leave beside
        # this one's (memory_fsdp2.beyond), and the fragmentation of every short-lived block
        extra, extra_short = (0.0, 0.0) if cache is None else memory_fsdp2.beyond(cache, parts)
        overhead = (GPU_OVERHEAD_BYTES + (options.fragmentation - 1.0) * (activations + stage_logits + extra_short)
                    + extra + options.reserved_share * (live + extra))
    else:
        overhead = CPU_PROCESS_OVERHEAD_BYTES
    # Same keys and order as MEMORY_PARTS (checked by the unit tests).
    return {
        "weights": int(weights), "gradients": int(gradients), "optimizer": int(optimizer),
        "activations": int(activations), "logits": int(stage_logits),
        "buffers": int(buffers), "overhead": int(overhead),
        **({HOST_KEY: int(offloaded)} if host else {}),
    }


def _fsdp2_transient(c: _StageTerms, i: int, layers_i: int, held_layers: float) -> memory_fsdp2.StageBytes:
    """Stage ``i``'s activations and loss bytes as FSDP2's phases hold them. The loss's bytes at its
    backward: a fused loss keeps the logits and their gradient in d bytes; an eager one its fp32 copies
    (the d-byte logits are dropped before the backward: ``pipette.memory_fsdp2``)."""
    a, p, m, t = c.acts, c.config.pp, c.config.grad_accum, c.config.tp
    last = i == p - 1
    loss = a.logits if c.options.fused_loss else a.logits - a.logits_d
    whole = (i == 0 and t > 1 and c.options.tp_embedding_grad_whole and c.options.sequence_parallel
             and c.training.method == "full")
    embed_grad = c.model.vocab * c.model.hidden * c.training.dtype_bytes * (1 - 1 / t) if whole else 0.0
    return memory_fsdp2.StageBytes(
        kept=held_layers * a.per_layer, rebuilt=a.rebuilt if layers_i else 0.0, head=a.head if last else 0.0,
        loss=loss if last else 0.0, logits_grad=a.logits_d if last else 0.0, layers=layers_i, last=last,
        grads_in_backward=p == 1 and m > 1, all_logits=a.logits if last else 0.0, embed_grad=embed_grad,
    )


def _balanced_stage_layers(model: ModelSpec, config: ParallelConfig, balance: str) -> tuple[int, ...]:
    """Layers per pipeline stage under ``MemoryOptions.stage_balance``."""
    if balance == "compute":
        return compute_balanced_stage_layers(model, config.pp)
    if balance == "embedding_loss":
        split = embedding_loss_stage_layers(model.layers, config.pp, config.virtual_stages)
        if split is not None:
            return split
    return tuple(config.layers_per_stage(model.layers))


def embedding_loss_stage_layers(layers: int, pp: int, virtual_stages: int = 1) -> tuple[int, ...] | None:
    """Layers per pipeline stage as Megatron-Core splits them with ``account_for_embedding_in_pipeline_split``
    and ``account_for_loss_in_pipeline_split`` (megatron/core/transformer/transformer_block.py,
    ``get_num_layers_to_build``: the embedding and the loss each count as one layer, and layers + 2 split
    evenly over pp x virtual stages; Megatron-Bridge's Llama 3.1 405B recipes set both: 126 + 2 over 8 x 4):
    the first and the last stage hold one decoder layer fewer. None where the layers alone split evenly
    (the flags are not needed) or layers + 2 do not either."""
    chunks = pp * virtual_stages
    if pp == 1 or layers % chunks == 0 or (layers + 2) % chunks:
        return None
    per_stage = (layers + 2) // pp
    return tuple(per_stage - (1 if i in (0, pp - 1) else 0) for i in range(pp))


def compute_balanced_stage_layers(model: ModelSpec, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage as nanotron balances them by compute cost (``get_block_compute_costs``
    of its Llama, nanotron/models/llama.py; the split as tests/benchmarks/memory_accuracy.py read it
    before it moved here): blocks in order
    are the embedding (cost 0), each decoder layer (4 a d_head h + 3 f h), the final norm (0), the
    LM head (V h), the cast and the loss (0); a stage takes blocks until the cumulative cost passes
    (stage + 1) / pp of the total. The LM head counts as a block, so the last stage gets fewer
    layers and the first, which holds the most micro-batches under 1F1B, more."""
    h = model.hidden
    layer = 4 * model.heads * model.head_dim * h + 3 * model.ffn_hidden * h
    costs = [0] + [layer] * model.layers + [0, model.vocab * h, 0, 0]
    total = sum(costs)
    counts = [0] * pp
    stage, cumulative = 0, 0
    for k, cost in enumerate(costs):
        cumulative += cost
        if 1 <= k <= model.layers:
            counts[stage] += 1
        if cumulative > total * (stage + 1) / pp and stage < pp - 1:
            stage += 1
    return tuple(counts)


#: The key under which ``stage_breakdowns(..., host=True)`` gives a stage's host bytes.
HOST_KEY = "host"


def _fsdp2_state(
    config: ParallelConfig, training: TrainingSpec, layers: int, layer_psi: float, root_psi: float,
    psi: float, trainable: float, layer_trainable: float, *, offload: bool,
) -> tuple[memory_fsdp2.Fsdp2Bytes, float]:
    """One rank of a stage's bytes under FSDP2, apart by when they are alive (``pipette.memory_fsdp2``
    picks the heaviest moment), and its host bytes.

    Sources: the ``fully_shard`` documentation (torch.distributed.fsdp, FSDP2) and torchtitan's
    ``apply_fsdp`` / docs/fsdp.md, with the ZeRO paper's accounting (Rajbhandari et al. 2020,
    sec. 3, Psi parameters, N_d shards):

    - the parameters are kept sharded on dim 0 in the dtype the model was built in (fp32: the
      runner and torchtitan build it so) over the shard degree ``N_s`` (``dp_shard`` under HSDP,
      all of dp otherwise; 1 under NO_SHARD): ``4 Psi / N_s``; they are also the optimizer's
      (fp32) master, so there is no separate master copy;
    - the gradients are reduce-scattered in ``reduce_dtype`` fp32 into sharded fp32 gradients
      (``MixedPrecisionPolicy``): ``4 Psi_train / N_s``; Adam's two moments ``8 Psi_train / N_s``;
    - each decoder layer is one FSDP unit, all-gathered to unsharded parameters in
      ``param_dtype`` (d bytes) before use: with ``reshard_after_forward`` (zero_stage 3) they are
      freed after the layer's forward and gathered again for its backward, and FSDP2's implicit
      prefetching gathers the next layer while one computes: two layers in flight. Without it
      (zero_stage 2, and NO_SHARD's replicas) every layer's unsharded parameters stay from its
      forward until its backward: the whole stage. The stage itself is the root unit (embedding,
      final norm, head), resharded after the forward as the layers are (the flag is given to
      ``fully_shard``) and gathered again for the head's backward;
    - in the backward a layer's unsharded gradients (d bytes) and their fp32 copy for the
      reduce-scatter (``reduce_dtype``) are alive together: one decoder layer's worth;
    - ``CPUOffloadPolicy`` keeps the sharded parameters, gradients and optimizer states in host
      memory (the optimizer steps on the CPU): they leave the device and count as host bytes;
      the unsharded (gathered) parameters are on the device as before.
    """
    c, d = config, training.dtype_bytes
    shards = 1 if c.zero_stage == 0 else (c.dp_shard or c.dp)
    state_bytes = (2 if training.optimizer in ("adam", "adamw") else 1) * FP32_BYTES
    sharded = psi * FP32_BYTES / shards
    gradients = trainable * FP32_BYTES / shards
    optimizer = trainable * state_bytes / shards
    # Under pipelining a stage's layers stay unsharded: torchtitan's ``apply_fsdp`` turns
    # reshard_after_forward off ("to avoid per-microbatch all-gathers"), and for every micro-batch
    # but the last torch.distributed.pipelining's ``PipelineStage`` (Pipette's runner too:
    # workers/rank/fsdp_pipeline.py) sets ``set_reshard_after_backward(False)`` and
    # ``set_requires_gradient_sync(False)`` on an FSDPModule, so the unsharded gradients (param
    # dtype) accumulate and are reduce-scattered at the last micro-batch only
    reshard = c.zero_stage == 3 and c.pp == 1
    kept = 0.0 if reshard else (root_psi + layers * layer_psi) * d
    # every unit's, the root's too (FSDPParam.to_accumulated_grad_if_needed; traced: docs/results.md)
    accumulated = trainable * FP32_BYTES if c.pp > 1 and c.zero_stage >= 2 else 0.0
    # one decoder layer's: the root's (embedding, head) are reduced at the end of the backward,
    # after the activations that make the peak are freed
    reduce = (layer_trainable if layers else 0.0) * (d + FP32_BYTES)
    host = 0.0
    if offload:
        host = sharded + gradients + accumulated + optimizer
        sharded = gradients = accumulated = optimizer = 0.0
    return memory_fsdp2.Fsdp2Bytes(
        sharded=sharded, optimizer=optimizer, sharded_grads=gradients, accumulated_grads=accumulated, kept=kept,
        root=root_psi * d, layer=(layer_psi * d if layers else 0.0), reduce=reduce, reshard=reshard,
    ), host


def _layer_activations(
    model: ModelSpec, s: int, b: int, d: int
) -> tuple[float, float, float, float]:
    """Bytes one layer stores for one micro-batch: (split by t, k and v, sequence part, scores).

    GPT (Korthikanti eq. 1, d = 2): attention 11sbh + 5as^2b, MLP 19sbh, LayerNorms 4sbh,
    i.e. sbh(34 + 5as/h); 24sbh are split by t (Q, K, V, context, MLP inner) and 10sbh
    (LayerNorm inputs and outputs, dropout masks) only with sequence parallelism.
    Term by term with d bytes: Q, K 2dsbh; V dsbh; context dsbh; GeLU in/out 2 x 4dsbh
    -> 12d; LN in + out 2 x 2dsbh, two 1-byte dropout masks -> 4d + 2; softmax output d,
    its dropout mask 1 and dropout output d per score -> (2d + 1)as^2b.

    Llama adaptation: no dropout (no masks); RMSNorm stores its input like LayerNorm, and
    its output is the input of the next matmul (norm in + out, both norms: 4dsbh); Q is
    dsbh but K and V are dsb*kv each under grouped-query attention; the context (flash
    output, input of o_proj) dsbh; the SwiGLU MLP keeps the gate and up outputs, the SiLU
    output and their product (input of down_proj), 4dsbf. The scores, when stored (eager
    attention), are the softmax output only: d*as^2b.
    """
    if model.moe is not None or model.attention is not None:
        return memory_moe.layer_activations(model, s, b, d)
    sbh = s * b * model.hidden
    kv = 2 * d * s * b * model.kv_dim
    if model.arch == "gpt":
        split = 12 * d * sbh - kv
        seq = (4 * d + 2) * sbh
        scores = (2 * d + 1) * model.heads * s * s * b
    else:
        split = d * s * b * (2 * model.hidden + 4 * model.ffn_hidden)
        seq = 4 * d * sbh
        scores = d * model.heads * s * s * b
    return float(split), float(kv), float(seq), float(scores)


def _op_sac_saved(model: ModelSpec, s: int, b: int, d: int, t: int, t_kv: int, sequence_parallel: bool) -> float:
    """Bytes one Llama layer keeps for one micro-batch under torchtitan's per-op checkpointing
    (``MemoryOptions.op_sac``). The mm count runs wq, wk, wv, wo, w1, w3, w2 (torchtitan's
    Attention and FeedForward: ``w2(silu(w1(x)) * w3(x))``); the odd ones are saved: wq (h), wv
    (the kv width), w1 (f), w2 (h, the layer's last output before the residual add); with the
    SDPA output (h) and the layer's input (h, the checkpoint's own). Column-parallel outputs and
    the attention are split by t, the input by t under sequence parallelism. w2 is row-parallel:
    its mm's own output is the whole sequence's partial sum (h, not split) and, under sequence
    parallelism, the reduce-scatters of wo's and w2's partial sums are saved too (the policy's
    ``reduce_scatter_tensor``: h/t each). Traced at Llama 70B tp8: 2.08 s b h d per layer
    (docs/results.md, "Traced memory")."""
    sb, h = s * b, model.hidden
    split = sb * (h + h + memory_moe.dense_ffn(model)) / t  # wq, SDPA output, w1
    seq = sb * h * (1 + 3 / t) if sequence_parallel and t > 1 else 2 * sb * h  # w2 (+ reduce-scatters), input
    return float(d * (split + sb * model.kv_dim / t_kv + seq))


def _te_layer(
    model: ModelSpec, training: TrainingSpec, s: int, b: int, d: int, split: float, seq: float,
    options: MemoryOptions,
) -> tuple[float, float]:
    """``_layer_activations``' split and sequence parts of a Llama-style layer as Megatron-Core with
    Transformer Engine stores them: the fused SwiGLU keeps no SiLU output (``fused_swiglu``: minus
    ``dsbf`` on a dense MLP; the experts' are ``memory_moe``'s); under a low-precision recipe
    (``linear_input_bytes`` q, full training) the attention norm's output and the dense MLP norm's and
    down projection's inputs are kept at q bytes instead of d, and the output projection keeps a q-byte
    copy of the attention's output beside the bf16 one the attention keeps. An MoE layer's MLP norm
    output stays in d: its router (a plain linear, not TE's) saves it for its weight gradient."""
    if model.arch != "llama":
        return split, seq
    sb, f, h = s * b, memory_moe.dense_ffn(model), model.hidden
    if options.fused_swiglu:
        split -= d * sb * f
    q = options.linear_input_bytes
    if q is not None and training.lora is None:
        norms = 1 if model.moe is not None else 2
        seq -= norms * (d - q) * sb * h
        split += q * sb * memory_moe.attention_output_width(model) - (d - q) * sb * f
    return split, seq


def _without_frozen_inputs(
    model: ModelSpec, training: TrainingSpec, s: int, b: int, d: int, split: float, seq: float
) -> tuple[float, float]:
    """``_layer_activations``' split and sequence parts without the inputs only frozen linear
    layers read (``MemoryOptions.frozen_inputs_saved`` False; Llama only): the attention norm's
    output (q, k, v's input) unless q, k or v has an adapter, the MLP norm's output (gate and
    up's input) unless gate or up has one, the SiLU-gate product (down's input) unless down has
    one. The context (o's input) stays: the fused attention keeps its output for its backward
    (Dao 2023, sec. 3.1), as it keeps q, k and v; SiLU and the product keep gate and up."""
    if model.arch != "llama" or training.lora is None:
        return split, seq
    targets = set(training.lora.targets)
    sbh = s * b * model.hidden
    if not targets & {"q_proj", "k_proj", "v_proj"}:
        seq -= d * sbh
    if not targets & {"gate_proj", "up_proj"}:
        seq -= d * sbh
    if "down_proj" not in targets:
        split -= d * s * b * model.ffn_hidden
    return split, seq


def trainable_params(model: ModelSpec, training: TrainingSpec) -> int:
    """Parameters the optimizer updates, whole model: all of them, or the adapters only."""
    if training.lora is None:
        return model.total_params()
    return int(model.layers * _lora_params_per_layer(model, training, 1))


def _lora_params_per_layer(model: ModelSpec, training: TrainingSpec, t: int) -> float:
    """Adapter parameters of one layer on one tensor-parallel rank (Hu et al. 2021).

    Each target W (in x out) gets A (in x r) and B (r x out): r(in + out). A column-
    parallel W (q, k, v, gate, up: out split by t) splits B and replicates A; a row-
    parallel W (o, down: in split by t) splits A and replicates B.
    """
    if training.lora is None:
        return 0.0
    r = training.lora.rank
    shapes = model.linear_shapes()
    total = 0.0
    for name in training.lora.targets:
        if name not in shapes:
            continue  # a target the architecture lacks (gate_proj on GPT) has no adapter
        n_in, n_out = shapes[name]
        if name in ("o_proj", "down_proj"):
            total += r * n_in / t + r * n_out
        else:
            total += r * n_in + r * n_out / t
    return total


def _after_backward(config: ParallelConfig, options: MemoryOptions, grad_bytes: int, gradients: float,
                    freed: float) -> float:
    """What DeepSpeed's ZeRO-0 adds to the step's peak with its flat all-reduce copy of the gradients,
    made after the backward, when ``freed`` (the activations and logits) is gone: the peak is the
    larger of the two moments (``MemoryOptions.deepspeed_zero``)."""
    if not options.deepspeed_zero or config.zero_stage != 0 or config.dp == 1:
        return 0.0
    return max(0.0, min(float(options.dp_bucket_elements) * grad_bytes, gradients) - freed)


def _buffers(
    config: ParallelConfig,
    bucket_psi: float,
    layer_psi: float,
    grad_bytes: int,
    d: int,
    options: MemoryOptions,
) -> float:
    """Communication buffers live during the backward pass, in bytes; ``bucket_psi``: the trainable
    parameters a bucket never exceeds."""
    if options.deepspeed_zero and config.zero_stage in (1, 2):
        # DeepSpeed's ZeRO-1/2 optimizer: its reduce buffers at any dp, two without a pipeline
        copies = 1 if config.pp > 1 else 2
        return copies * min(float(options.zero_bucket_elements), bucket_psi) * grad_bytes
    if config.dp == 1 or (options.deepspeed_zero and config.zero_stage == 0):
        return 0.0  # DeepSpeed's ZeRO-0 copy comes after the backward (_stage)
    # ZeRO-0 all-reduces and ZeRO-1/2/3 reduce-scatter the gradients through one flat
    # bucket (DeepSpeed allreduce_bucket_size / reduce_bucket_size), never bigger than
    # the gradients themselves.
    elements = options.dp_bucket_elements if config.zero_stage == 0 else options.zero_bucket_elements
    bucket = min(float(elements), bucket_psi) * grad_bytes
    if config.zero_stage < 3:
        return bucket
    # ZeRO-3 gathers each layer's parameters before use and prefetches the next ones
    # (Rajbhandari et al. 2020, sec. 5.3), bounded by stage3_max_live_parameters.
    live = min(layer_psi + ZERO3_PREFETCH_ELEMENTS, ZERO3_MAX_LIVE_PARAMETERS) * d
    return bucket + live


def _notes(training: TrainingSpec, config: ParallelConfig, options: MemoryOptions,
           device_kind: str) -> tuple[str, ...]:
    notes = []
    if options.flash_attention:
        notes.append("flash attention: no a*s^2 scores stored")
    if config.recompute != "none":
        notes.append(f"{config.recompute} activation recomputation")
    if training.is_lora:
        notes.append("LoRA: frozen base has no gradients or optimizer state")
    if options.grad_accum_fp32:
        notes.append("fp32 gradient accumulation buffers")
    if config.cp > 1:
        notes.append(f"context parallel cp={config.cp}: {training.seq_len // config.cp} tokens a rank, "
                     f"KV exchange {options.cp_exchange(device_kind)[0]}")
    return tuple(notes)


__all__ = [
    "DEFAULT_OPTIONS",
    "FRAGMENTATION",
    "FSDP_COMPILE_FRAGMENTATION",
    "FSDP_FRAGMENTATION",
    "FSDP_OPTIONS",
    "GPU_OVERHEAD_BYTES",
    "HOST_KEY",
    "MEGATRON_OPTIONS",
    "NANOTRON_FRAGMENTATION",
    "NANOTRON_OPTIONS",
    "SAFETY_MARGIN",
    "MemoryOptions",
    "estimate_memory",
    "stage_breakdowns",
]
