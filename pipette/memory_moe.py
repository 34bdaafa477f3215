"""The memory of a Mixture-of-Experts model's MLPs on one rank, stage by stage: what
``pipette.memory`` adds for a model with ``moe`` (its dense path holds the attention, the norms,
the embedding and the head; ``ModelSpec.linear_shapes`` gives it the attention only).

Degrees: ``t`` tensor parallel, ``ep`` expert parallel, ``etp`` expert tensor parallel (Megatron-Core's
``expert_tensor_parallel_size``; ``None`` on a candidate: equal to ``t``, Megatron-Core's default), and
the expert data-parallel degree ``edp = t * dp * cp / (ep * etp)`` (Megatron-Core's expert
``RankGenerator``: ``dp = world // (etp * ep * pp)``, megatron/core/parallel_state.py; torchtitan's
``dp_shard_mod_ep`` mesh, torchtitan/distributed/parallel_dims.py; DeepSpeed's expert data-parallel
group, ``dp_world_size // ep_size``, deepspeed/utils/groups.py).

Parameters per rank of a stage (``E`` routed experts of ``3 h f_e`` each, ``k`` of them per token):

* a dense MLP layer (DeepSeek's first layers): ``3 h f / t``, sharded like the attention (ZeRO /
  distributed optimizer / FSDP over ``dp``);
* an MoE layer's part every rank holds: the router ``h E`` (replicated over ``t``: Megatron-Core's
  ``TopKRouter`` weight is not split) and the shared experts ``3 h f_s / t`` (+ Qwen's gate ``h``),
  sharded over ``dp`` too;
* its routed experts: ``E / ep`` local experts of ``3 h f_e / etp`` each; their gradients and
  optimizer states (and under ZeRO-3/FSDP their weights) sharded over ``edp``, not ``dp``
  (Megatron-Core's distributed optimizer keeps an expert-parallel buffer reduced over the expert
  data-parallel group; DeepSpeed partitions expert states over it: ``deepspeed/moe/utils.py``
  ``split_params_into_different_moe_groups_for_optimizer``; torchtitan's ``fully_shard`` of the
  experts over ``dp_shard_mod_ep``).

Activations of one MoE layer for one micro-batch, with ``T_r = s b / t`` tokens routed per rank
(Megatron-Core requires sequence parallelism for MoE under ``t > 1``), ``k`` copies of each
(``c = capacity_factor`` caps them at ``c T_r k``; dropless: ``T_r k``), ``d`` bytes per element:

* router: logits and scores ``T_r E (d + 4)`` (scores in fp32) and the routing map ``8 T_r k``;
* dispatch: the permuted tokens ``d T_r k h`` (fc1's saved input), the experts' SwiGLU
  ``4 d T_r k f_e / etp`` (gate, up, SiLU, product: as the dense MLP of ``pipette.memory``), their
  output before the combine ``d T_r k h`` (kept for the probabilities' gradient);
* the shared experts ``4 d s b f_s / t`` and a dense layer's MLP ``4 d s b f / t``;
* buffers: the all-to-all's send-side copy of one layer, ``d T_r k h`` (the permuted local tokens,
  freed once the exchange lands; the receive side is the experts' saved input, counted above).

Multi-head latent attention (DeepSeek-V2 sec. 2.1) stores its latents ``c_q`` (``q_lora_rank``) and
``c_kv`` plus the shared rotary key (``kv_lora_rank + qk_rope_head_dim``) before and after their
norms, and the up-projected q, k (``heads x qk_head_dim``) and v (``heads x v_head_dim``):
``layer_activations``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.moe import MoeSpec
from pipette.moe_count import expert_params
from pipette.routing import capacity_of
from pipette.training import TrainingSpec

FP32_BYTES = 4
#: bytes per routing-map entry (int64 indices: Megatron-Core's ``routing_map`` / torchtitan's indices)
INDEX_BYTES = 8
#: the names of an expert's matrices as LoRA targets (transformers' module names)
EXPERT_TARGETS: dict[str, str] = {"gate_proj": "in", "up_proj": "in", "down_proj": "out"}


@dataclass(frozen=True)
class ExpertDegrees:
    """The expert mesh of one candidate: ``ep``, ``etp`` and the expert data-parallel degree."""

    ep: int
    etp: int
    edp: int

    @classmethod
    def of(cls, config: ParallelConfig, experts: int) -> ExpertDegrees:
        etp = config.tp if config.etp is None else config.etp
        ranks = config.tp * config.dp * config.cp
        if experts % config.ep:
            raise SpecError(f"ep={config.ep} does not divide the {experts} experts", field="config.ep",
                            fix=f"use an ep that divides {experts}")
        if ranks % (config.ep * etp):
            raise SpecError(f"ep x etp = {config.ep * etp} does not divide tp x dp x cp = {ranks}",
                            field="config.ep", fix="use ep and etp whose product divides tp x dp x cp")
        return cls(config.ep, etp, ranks // (config.ep * etp))


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the recipe, as ``pipette.memory`` works them out for the dense part."""

    weight: float  # d, or what FP8 weights leave
    grad: int
    state: int  # the optimizer's moments
    master: int
    shard_master: bool
    fsdp2: bool


def moe_of(model: ModelSpec) -> MoeSpec:
    if model.moe is None:
        raise SpecError(f"{model.name} has no experts", field="model.moe",
                        fix="price a dense model with pipette.memory")
    return model.moe


def stage_mlp_layers(model: ModelSpec, layers: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """(dense, MoE) MLP layers of each pipeline stage, the stages holding consecutive layers."""
    dense = set(moe_of(model).dense_layers)
    out, first = [], 0
    for n in layers:
        d = sum(1 for i in range(first, first + n) if i in dense)
        out.append((d, n - d))
        first += n
    return out


#: DeepEP's normal-kernel configs (deep_ep/buffer.py, ``Buffer.get_dispatch_config`` and
#: ``get_combine_config``): the NVLink receive window in tokens per channel and peer, by expert-parallel
#: group size (the sizes it supports; the RDMA window is 128 at every size)
DEEPEP_NVL_RECV_TOKENS: dict[int, int] = {2: 256, 4: 256, 8: 256, 16: 288, 24: 288, 32: 288, 64: 288, 128: 560,
                                          144: 720, 160: 720}
DEEPEP_RDMA_RECV_TOKENS = 128
#: SMs DeepEP's kernels take (Megatron-Core's ``--moe-deepep-num-sms`` default); a channel is two SMs
DEEPEP_SMS = 20
#: NVLink peers DeepEP's normal kernels reach directly (``NUM_MAX_NVL_PEERS``); the rest over RDMA
DEEPEP_NVL_PEERS = 8
#: per token slot: top-k indices (int64) and weights, and FP8 scales (fp32), for at most 128 of each, and
#: its 8-byte source metadata (csrc/config.hpp, ``kNumMaxTopK``, ``kNumMaxScales``, ``SourceMeta``)
_DEEPEP_SLOT_BYTES = 128 * 8 + 128 * 4 + 128 * 4 + 8


def flex_buffer_bytes(hidden: int, group: int) -> float:
    """Bytes of the communication buffer the flex dispatcher allocates once per rank (DeepEP's
    ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` as Megatron-Core's ``fused_a2a.get_buffer`` sizes it:
    the larger of the dispatch and combine configs' hints, ``Config.get_nvl_buffer_size_hint`` and
    ``get_rdma_buffer_size_hint`` of csrc/config.hpp, for ``hidden x 2`` bytes a token). ``group`` is
    the expert tensor x expert parallel group; 0 for a group DeepEP's configs do not list."""
    if group < 2 or group not in DEEPEP_NVL_RECV_TOKENS:
        return 0.0
    channels = DEEPEP_SMS // 2
    token = hidden * 2
    rdma = max(group // DEEPEP_NVL_PEERS, 1)
    nvl = min(group, DEEPEP_NVL_PEERS)
    recv = DEEPEP_NVL_RECV_TOKENS[group]
    nvl_bytes = channels * nvl * ((2 * rdma + 3) * 4 + recv * (token + _DEEPEP_SLOT_BYTES))
    rdma_bytes = 0.0
    if group > DEEPEP_NVL_PEERS:
        rdma_bytes = channels * rdma * ((DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4
                                        + DEEPEP_RDMA_RECV_TOKENS * 2 * (token + _DEEPEP_SLOT_BYTES + 16)) + 2 ** 20
    return float(nvl_bytes + rdma_bytes)


def routed_tokens(moe: MoeSpec, tokens: float, config: ParallelConfig | None = None) -> float:
    """Token copies one rank's experts are sized for from ``tokens`` routed: ``k`` each, and with a
    capacity factor (the candidate's routing, else the model's: ``pipette.routing``) that factor times
    it (GShard sec. 2.2): the all-to-all dispatcher pads every expert to its capacity
    (``--moe-pad-expert-input-to-capacity``, written with it), the flex dispatcher drops without padding
    and holds at most that many."""
    copies = tokens * moe.top_k
    capacity = capacity_of(moe.capacity_factor, None if config is None else config.routing)
    return copies * capacity if capacity is not None else copies


def routed_load(moe: MoeSpec, tokens: float, config: ParallelConfig, imbalance: float) -> float:
    """Token copies the busiest rank's experts compute from ``tokens`` routed per rank: ``k`` each
    times the router's ``imbalance`` dropless; padded to the capacity under the all-to-all dispatcher;
    the imbalance up to the capacity under the flex dispatcher (drops, no padding)."""
    copies = tokens * moe.top_k
    capacity = capacity_of(moe.capacity_factor, config.routing)
    if capacity is None:
        return copies * imbalance
    return copies * (min(imbalance, capacity) if config.dispatcher == "flex" else capacity)


def mlp_params(model: ModelSpec, config: ParallelConfig) -> tuple[float, float, float]:
    """Per rank: (a dense MLP layer's, an MoE layer's replicated part, an MoE layer's local experts)."""
    moe, h, t = moe_of(model), model.hidden, config.tp
    deg = ExpertDegrees.of(config, moe.experts)
    dense = 3 * h * model.ffn_hidden / t
    router = h * moe.experts + (moe.experts if moe.router_bias else 0)
    shared = 3 * h * moe.shared_ffn / t + (h if moe.shared_gate else 0)
    experts = moe.experts / deg.ep * expert_params(model) / deg.etp
    return dense, router + shared, experts


def lora_mlp_params(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> tuple[float, float, float]:
    """Adapter parameters per rank of the MLP targets (gate_proj, up_proj, down_proj): on a dense
    MLP layer, on the shared experts, and on the local experts (each its own adapters; Hu et al.
    2021: ``r (in + out)`` per matrix, the split side divided by the degree as in ``pipette.memory``)."""
    if training.lora is None:
        return 0.0, 0.0, 0.0
    moe, h, r = moe_of(model), model.hidden, training.lora.rank
    deg = ExpertDegrees.of(config, moe.experts)

    def adapters(f: int, split: int) -> float:
        total = 0.0
        for name, side in EXPERT_TARGETS.items():
            if name in training.lora.targets:  # type: ignore[union-attr]
                total += r * h + r * f / split if side == "in" else r * f / split + r * h
        return total

    local = moe.experts / deg.ep
    return adapters(model.ffn_hidden, config.tp), adapters(moe.shared_ffn, config.tp) if moe.shared_ffn else 0.0, \
        local * adapters(moe.expert_ffn, deg.etp)


def layer_activations(model: ModelSpec, s: int, b: int, d: int) -> tuple[float, float, float, float]:
    """``pipette.memory._layer_activations`` for a model with ``attention`` or ``moe``: (split by t,
    k and v, sequence part, scores), the attention's widths as the model has them (head_dim, MLA);
    the MLP's part only for a model without experts (an MoE layer's is ``stage_terms``')."""
    a = model.attention
    sb = s * b
    mla = a.mla if a is not None else None
    if mla is None:
        q, k, v = model.heads * model.head_dim, model.kv_dim, model.kv_dim
        latent = 0
    else:
        q, k, v = (model.heads * mla.qk_head_dim,) * 2 + (model.heads * mla.v_head_dim,)
        latent = 2 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim)  # before and after norms
    ctx = model.heads * (mla.v_head_dim if mla is not None else model.head_dim)
    mlp = 0 if model.moe is not None else 4 * model.ffn_hidden
    split = d * sb * (q + ctx + mlp)
    seq = d * sb * (4 * model.hidden + latent)
    return float(split), float(d * sb * (k + v)), float(seq), float(d * model.heads * s * s * b)


def attention_output_width(model: ModelSpec) -> int:
    """The width of the attention's output (the output projection's input): heads x v_head_dim under MLA,
    heads x head_dim otherwise."""
    mla = model.attention.mla if model.attention is not None else None
    return model.heads * (mla.v_head_dim if mla is not None else model.head_dim)


def without_mla_up_proj(model: ModelSpec, s: int, b: int, d: int, split: float, kv: float) -> tuple[float, float]:
    """``layer_activations``' split and k, v parts with MLA's up-projected q, k and v recomputed (Megatron-Core's
    ``mla_up_proj`` recompute module: ``MLASelfAttention`` runs the up projections under
    ``CheckpointWithoutOutput`` and discards their outputs once the core attention has saved them,
    megatron/core/transformer/multi_latent_attention.py); the latents stay, as the checkpoint's inputs.
    A model without MLA keeps its own."""
    mla = model.attention.mla if model.attention is not None else None
    if mla is None:
        return split, kv
    return split - d * s * b * model.heads * mla.qk_head_dim, 0.0


def kv_linear(model: ModelSpec) -> int:
    """The k and v weights ``pipette.memory`` splits over ``min(t, kv_heads)`` (grouped-query
    attention); 0 under MLA, whose ``kv_b_proj`` splits over ``t`` with the heads."""
    if model.attention is not None and model.attention.mla is not None:
        return 0
    return 2 * model.hidden * model.kv_dim


def dense_ffn(model: ModelSpec) -> int:
    """The MLP width the dense path's activation terms read: none for a model with experts."""
    return 0 if model.moe is not None else model.ffn_hidden


@dataclass(frozen=True)
class MlpSaving:
    """How a stack stores an MLP's activations (``pipette.memory_options.MemoryOptions``): the fused SwiGLU
    (no SiLU output), the linear inputs in the recipe's format (q bytes, None: the training dtype) and the
    recompute modules (``moe_act``: the routed experts' activation output dropped; ``mlp``: the layer's
    MLP rebuilt from its input)."""

    fused_swiglu: bool = False
    input_bytes: float | None = None
    recompute: tuple[str, ...] = ()


def swiglu_bytes(f: float, d: int, saving: MlpSaving, act_recomputed: bool = False) -> float:
    """Bytes per token a SwiGLU MLP of width ``f`` keeps between its two projections: the gate and up outputs
    (``2 d f``), the SiLU output (``d f``) unless fused (Megatron-Core's ``bias_swiglu_impl`` recomputes it),
    and the down projection's input (``d f``; q f where TE saves it quantized, none where ``moe_act``
    drops it and nothing quantized keeps a copy)."""
    down = saving.input_bytes if saving.input_bytes is not None else (0.0 if act_recomputed else d)
    return 2 * d * f + (0 if saving.fused_swiglu else d * f) + down * f


def layer_mlp_activations(model: ModelSpec, config: ParallelConfig, s: int, d: int,
                          saving: MlpSaving = MlpSaving()) -> tuple[float, float, float]:
    """Bytes one micro-batch keeps of (a dense MLP layer, an MoE layer) and one MoE layer's
    all-to-all buffers (the module docstring), the MLPs stored as ``saving`` says."""
    moe, h, t, b = moe_of(model), model.hidden, config.tp, config.mbs
    deg = ExpertDegrees.of(config, moe.experts)
    sb = s * b
    tokens = sb / t  # T_r: sequence-parallel tokens routed by each tensor rank
    copies = routed_tokens(moe, tokens, config)
    router = tokens * moe.experts * (d + FP32_BYTES) + INDEX_BYTES * tokens * moe.top_k
    # each copy: fc1's input (q bytes where TE's grouped linear saves it quantized), the SwiGLU, and the
    # experts' output before the combine (d)
    q_in = saving.input_bytes if saving.input_bytes is not None else d
    act_recomputed = "moe_act" in saving.recompute
    experts = copies * (q_in * h + d * h + swiglu_bytes(moe.expert_ffn / deg.etp, d, saving, act_recomputed))
    # the shared experts read the norm output the router keeps in d, and keep a q copy of it where quantized
    shared = 0.0
    if moe.shared_ffn:
        shared = sb / t * ((saving.input_bytes or 0.0) * h + swiglu_bytes(moe.shared_ffn, d, saving))
    dense = sb / t * swiglu_bytes(model.ffn_hidden, d, saving)
    return float(dense), float(router + experts + shared), float(d * copies * h)


def stage_terms(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, layers: tuple[int, ...] | list[int],
                nbytes: StateBytes, saving: MlpSaving = MlpSaving()) -> list[dict[str, float]]:
    """Per stage: the MLPs' weights, gradients, optimizer states (bytes per rank), their activations
    for one micro-batch (``per_micro_batch``), the heaviest layer's (``one_layer``: rebuilt under full
    recomputation) and the all-to-all buffers."""
    moe = moe_of(model)
    deg = ExpertDegrees.of(config, moe.experts)
    dense_p, shared_p, expert_p = mlp_params(model, config)
    dense_a, shared_a, expert_a = lora_mlp_params(model, training, config)
    act_dense, act_moe, dispatch = layer_mlp_activations(model, config, training.seq_len, training.dtype_bytes, saving)
    z, n_d, full = config.zero_stage, config.dp * config.cp, training.method == "full"
    out = []
    for dense, sparse in stage_mlp_layers(model, layers):
        # (parameters, adapters) sharded over dp x cp, and over edp
        replicated = dense * dense_p + sparse * shared_p
        local = sparse * expert_p
        train_r = replicated if full else dense * dense_a + sparse * shared_a
        train_e = local if full else sparse * expert_a
        terms = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0}
        for psi, trainable, shards in ((replicated, train_r, n_d), (local, train_e, deg.edp)):
            w, g, o = _state(psi, trainable, shards, z, nbytes, lora=not full)
            terms["weights"] += w
            terms["gradients"] += g
            terms["optimizer"] += o
        one = act_moe if sparse else (act_dense if dense else 0.0)
        buffers = dispatch if sparse else 0.0
        if sparse and config.dispatcher == "flex":
            buffers += flex_buffer_bytes(model.hidden, deg.ep * deg.etp)  # one buffer a rank, all layers
        kept_dense, kept_moe = act_dense, act_moe
        if "mlp" in saving.recompute:
            # only the MLP's input is kept (the norm output, the dense path's); one layer's MLP is rebuilt
            # at a time in the backward
            kept_dense, kept_moe = 0.0, 0.0
            buffers += one
        if nbytes.fsdp2 and dense + sparse:
            # FSDP2 gathers each layer's sharded MLP (its local experts over edp) in the parameter dtype
            # (pipette.memory._fsdp2_state): two layers in flight under FULL_SHARD without a pipeline,
            # the whole stage kept otherwise
            whole = (replicated + local) * nbytes.weight
            if z == 3 and config.pp == 1:
                buffers += whole * min(2, dense + sparse) / (dense + sparse)
            else:
                terms["weights"] += whole
        out.append({**terms, "per_micro_batch": dense * kept_dense + sparse * kept_moe, "one_layer": one,
                    "buffers": buffers})
    return out


def _state(psi: float, trainable: float, shards: int, zero: int, nbytes: StateBytes, *,
           lora: bool) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of ``psi`` parameters (``trainable`` of them trained)
    sharded over ``shards`` ranks: ZeRO's partitioning (Rajbhandari et al. 2020, sec. 3), or FSDP2's
    (fp32 sharded parameters that are the optimizer's master, ``pipette.memory._fsdp2_state``)."""
    base = trainable if not lora else psi + trainable
    if nbytes.fsdp2:
        shards = shards if zero > 0 else 1  # NO_SHARD: replicated
        return base * FP32_BYTES / shards, trainable * FP32_BYTES / shards, trainable * nbytes.state / shards
    w = base * nbytes.weight / (shards if zero >= 3 else 1)
    g = trainable * nbytes.grad / (shards if zero >= 2 else 1)
    master = nbytes.master / (shards if zero >= 1 and nbytes.shard_master else 1)
    o = trainable * (nbytes.state / (shards if zero >= 1 else 1) + master)
    return w, g, o


__all__ = ["EXPERT_TARGETS", "ExpertDegrees", "MlpSaving", "StateBytes", "attention_output_width", "dense_ffn",
           "flex_buffer_bytes",
           "kv_linear", "layer_activations", "layer_mlp_activations", "lora_mlp_params", "mlp_params", "routed_load",
           "routed_tokens", "stage_mlp_layers", "stage_terms", "swiglu_bytes", "without_mla_up_proj"]
