"""What the PyTorch-native runner (``workers.rank.fsdp``) cannot run, as pure rules: the planner's
``fsdp`` stack drops these candidates (``pipette.stacks.Stack.refusals``) and the trial's host refuses
them before any process starts (``workers.fsdp_spec.check_fsdp``): one list of rules for both.

Each problem is ``(message, field, fix)``: what, where, and how to fix it, in one line.
"""

from __future__ import annotations

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.training import TrainingSpec


def fsdp_problems(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str,
                  world: int | None) -> list[tuple[str, str, str]]:
    """Every (message, field, fix) that stops ``config`` on the fsdp runner; empty when it runs."""
    m, c = model, config
    out: list[tuple[str, str, str]] = []
    if world is not None and world != c.world:
        names, sizes = ("tp x pp x dp", f"{c.tp} x {c.pp} x {c.dp}") if c.cp == 1 else \
            ("tp x pp x dp x cp", f"{c.tp} x {c.pp} x {c.dp} x {c.cp}")
        out.append((f"{world} processes for a candidate of {names} = {sizes} = {c.world}",
                    "config", f"start {c.world} ranks, or choose degrees whose product is {world}"))
    out += model_problems(m, training, device_kind)
    if c.zero_stage == 1:
        out.append(("FSDP has no optimizer-only sharding (ZeRO-1)", "config.zero_stage",
                    "use 3 (FULL_SHARD), 2 (SHARD_GRAD_OP: no reshard after forward) or 0 (NO_SHARD)"))
    if c.zero_stage == 0 and c.dp_shard not in (None, 1):
        out.append((f"NO_SHARD (zero_stage 0) replicates, but dp_shard is {c.dp_shard}", "config.dp_shard",
                    "leave dp_shard out with zero_stage 0, or shard with zero_stage 2 or 3"))
    out += _split_problems(m, c)
    out += _pipeline_problems(m, c)
    out += moe_problems(m, c)
    out += _context_problems(training, c)
    # the family's attention (Qwen2's biases, Qwen3's q/k norms) takes tp (workers.rank.fsdp_parallel) and cp
    # (workers.rank.context_parallel.attention_classes) as Llama's does; what it cannot build model_problems says
    return out


def model_problems(model: ModelSpec, training: TrainingSpec, device_kind: str) -> list[tuple[str, str, str]]:
    """What stops the runner whatever the layout: the model it cannot build, the recipe it cannot run
    (a plan that finds no layout says these in one line, not as a count of refused layouts)."""
    m, out = model, []
    if m.arch != "llama":
        out.append((f"the runner builds Llama models, not {m.arch!r}", "model.arch", "use a Llama model"))
    a = m.attention
    if a is not None:
        # the dense model is the family's (workers.rank.hf_model); the MoE model's attention is Llama's
        moe_not_llamas = m.moe is not None and not a.is_llamas(m.hidden, m.heads, training.seq_len)
        what = a.differences(m.hidden, m.heads) if moe_not_llamas else a.unbuilt(m.hidden, m.heads, training.seq_len)
        if what:
            out.append((f"{m.name} has attention the runner's {'MoE ' if m.moe is not None else ''}model does not "
                        f"build ({what})", "model",
                        "tune it with your own training script (--script), or plan it with --stack megatron"))
    out += _moe_model_problems(m)
    if device_kind == "cpu" and training.dtype == "fp16":
        out.append(("fp16 needs a GPU", "training.dtype", "use fp32 or bf16 on CPU devices"))
    if training.seq_len > m.max_seq:
        out.append((f"seq_len {training.seq_len} exceeds the model's max_seq {m.max_seq}", "training.seq_len",
                    f"use at most {m.max_seq}"))
    return out


def _split_problems(m: ModelSpec, c: ParallelConfig) -> list[tuple[str, str, str]]:
    """Tensor parallelism shards heads, the MLP and the vocabulary over tp (DTensor
    ``parallelize_module``), and the sequence between them (sequence parallelism)."""
    out = []
    if c.tp > 1:
        for name, width in (("heads", m.heads), ("kv_heads", m.kv_heads), ("ffn_hidden", m.ffn_hidden),
                            ("vocab", m.vocab)):
            if width % c.tp:
                out.append((f"tp={c.tp} does not divide the model's {name}={width}", "config.tp",
                            f"use a tp that divides {name} ({_divisors(width)})"))
        if m.tied_embeddings:
            out.append(("tied embeddings cannot be split over tp: the embedding is cut by rows and the LM head "
                        "by columns of one weight", "config.tp", "use tp=1, or an untied model"))
    return out


def _pipeline_problems(m: ModelSpec, c: ParallelConfig) -> list[tuple[str, str, str]]:
    """``torch.distributed.pipelining``'s own limits (``schedules.py``): 1F1B needs at least as
    many micro-batches as stages, interleaved 1F1B a whole number of rounds."""
    if c.pp == 1:
        return []
    out = []
    stages = c.pp * (c.virtual_stages if c.schedule == "interleaved" else 1)
    if stages > m.layers:
        out.append((f"{stages} pipeline stages for {m.layers} layers", "config.pp",
                    f"use at most {m.layers} stages (pp x virtual_stages)"))
    if m.tied_embeddings:
        out.append(("tied embeddings across pipeline stages (the first stage's embedding is the last one's "
                    "head) are not supported by this runner", "config.pp", "use pp=1, or an untied model"))
    n = c.grad_accum
    if c.schedule == "1f1b" and n < c.pp:
        out.append((f"1F1B needs at least pp={c.pp} micro-batches per step, this candidate has {n}", "config.mbs",
                    f"use a micro-batch size of at most {c.global_batch // (c.dp * c.pp)}"))
    if c.schedule == "interleaved" and n % max(1, n // c.pp):
        out.append((f"interleaved 1F1B runs micro-batches in rounds of pp={c.pp}; {n} is not a whole number "
                    "of rounds", "config.mbs", f"choose mbs so that the {n} micro-batches are a multiple of pp"))
    return out


def _context_problems(training: TrainingSpec, c: ParallelConfig) -> list[tuple[str, str, str]]:
    """Ring attention cuts each sequence into ``2 cp`` load-balanced chunks and TP's sequence
    parallelism cuts a cp rank's part by tp: torchtitan's ``ParallelDims.seq_len_divisor``
    (``tp * cp * 2``, ``torchtitan/distributed/parallel_dims.py``)."""
    if c.cp == 1:
        return []
    divisor = 2 * c.cp * c.tp
    if training.seq_len % divisor:
        return [(f"seq_len {training.seq_len} is not divisible by 2 x cp x tp = {divisor} (ring attention's "
                 f"2 cp chunks, each cut by tp)", "training.seq_len",
                 f"use a sequence length that is a multiple of {divisor}, or a smaller cp")]
    return []


def moe_problems(m: ModelSpec, c: ParallelConfig) -> list[tuple[str, str, str]]:
    """What the runner's MoE feed-forward (``workers.rank.moe_layer``: a softmax top-k router
    renormalised as Mixtral's, SwiGLU experts without biases, an optional shared expert and its
    Qwen2-MoE gate, in every layer of a Llama) and its expert parallelism cannot run."""
    if m.moe is None:
        return [(f"ep={c.ep} for a dense model: expert parallelism splits the experts of an MoE model",
                 "config.ep", "use ep=1")] if c.ep > 1 else []
    e, out = m.moe, []
    if c.ep > 1 and e.experts % c.ep:
        out.append((f"ep={c.ep} does not divide the {e.experts} experts", "config.ep",
                    f"use an ep that divides {e.experts} ({_divisors(e.experts)})"))
    if c.ep > 1 and c.cp > 1:
        out.append((f"ep={c.ep} with cp={c.cp}: the runner does not combine expert and context parallelism yet",
                    "config.ep", "use cp=1 with ep > 1, or ep=1 with cp > 1"))
    if c.tp > 1:
        # torchtitan's etp=1 keeps experts whole on each tp rank and needs its MoE's own TP plan
        # (apply_moe_ep_tp); the runner's tensor parallelism is the dense MLP's
        out.append((f"tp={c.tp} with an MoE model: the runner's MoE layers are not tensor-parallel", "config.tp",
                    "use tp=1 (expert parallelism over the data-parallel ranks: ep)"))
    return out


def _moe_model_problems(m: ModelSpec) -> list[tuple[str, str, str]]:
    """What of an MoE model the runner's MoE layer does not build (its attention: ``model_problems``)."""
    e = m.moe
    if e is None:
        return []
    fix = "use a model of Mixtral's, Qwen2-MoE's or Qwen3-MoE's routing (e.g. tiny-moe)"
    return [(f"{m.name} has {what}, which the runner's MoE model does not build", "model", fix) for what, present in (
        (f"router scoring {e.scoring!r} (the runner's router is a softmax)", e.scoring != "softmax"),
        (f"group-limited routing ({e.groups} groups)", e.groups > 1),
        ("router or expert biases (gpt-oss)", e.router_bias or e.expert_bias),
        (f"dense layers {list(e.dense_layers)} among the MoE ones", bool(e.dense_layers)),
        (f"{e.mtp_layers} multi-token-prediction module(s)", e.mtp_layers > 0),
    ) if present]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)


__all__ = ["fsdp_problems", "model_problems", "moe_problems"]
