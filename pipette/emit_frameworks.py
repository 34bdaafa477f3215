"""What a Megatron-LM or nanotron user pastes into their own job for a candidate.

Pipette runs neither framework; it prices them (the ``megatron`` and ``nanotron`` stacks). So it
writes the part of their configuration the candidate decides, in each framework's own words, and
leaves the model, data and optimizer to the user's job:

* ``megatron_args.txt``: ``pretrain_gpt.py`` arguments (megatron/training/arguments.py of
  Megatron-LM): the tensor, pipeline and context-parallel degrees (``--context-parallel-size``,
  written only above 1; data parallelism is what the world size leaves),
  sequence parallelism with tp (what the megatron stack prices), the batch, the distributed
  optimizer for ZeRO-1, the virtual stages of an interleaved schedule, recomputation and
  precision, Transformer Engine's layers and TP overlap under ``megatron+te`` and the recipes
  (``engine_flags``; under ``megatron+fp8`` Transformer Engine's FP8 with FP8 weights, as priced, on a
  device with FP8 tensor cores; ``+mxfp8`` and ``+nvfp4`` their block-scaled recipes on Blackwell).
  Megatron-LM numbers ranks tp fastest, then dp, then pp (its default order
  ``tp-cp-ep-dp-pp``, megatron/core/parallel_state.py ``initialize_model_parallel``), as Pipette's
  rank map does, so ranks started node by node in the
  hostfile's order land where the plan put them.
* ``nanotron.yaml``: the ``parallelism``, ``tokens`` and ``optimizer`` keys of a nanotron config
  (nanotron/config/parallelism_config.py and config.py: ``ParallelismArgs``, ``TokensArgs``,
  ``OptimizerArgs``), with the settings the nanotron stack's memory estimate assumes: the 1F1B
  engine (nanotron's default is all-forward-all-backward), sequence-parallel TP
  (``REDUCE_SCATTER``; its default is ``ALL_REDUCE``), the all-gather recomputed in the backward
  and fp32 gradient accumulation.
"""

from __future__ import annotations

from pipette.config import ParallelConfig
from pipette.moe import MoeSpec
from pipette.routing import capacity_of
from pipette.training import TrainingSpec

MEGATRON_ARGS = "megatron_args.txt"
NANOTRON_CONFIG = "nanotron.yaml"
#: Said where a ``tf32`` job's file cannot switch TF32 on itself (neither framework has a flag for it,
#: nor a script without a ``tf32`` knob: ``pipette.emit_script``).
TF32_NOTE = ("# TF32: priced with fp32 matmuls on TF32 tensor cores, which PyTorch leaves off for matmuls;",
             "# turn them on in your entry point: torch.set_float32_matmul_precision(\"high\")")


def tf32_note(training: TrainingSpec) -> list[str]:
    """``TF32_NOTE`` for a ``tf32`` job, nothing for another."""
    return list(TF32_NOTE) if training.dtype == "tf32" else []


def megatron_arguments(training: TrainingSpec, config: ParallelConfig, layers: int,
                       options: tuple[str, ...] = (), device_fp8: bool = True, device_fp4: bool = True,
                       moe: MoeSpec | None = None, flex_backend: str = "deepep") -> list[str]:
    """``pretrain_gpt.py`` arguments for ``config``, one flag (with its value) per item; FP8 or FP4
    only where the option is chosen and the device has it (on an A100 the option prices nothing);
    an MoE model's experts and their parallelism with ``moe`` (``moe_arguments``)."""
    args = [
        f"--tensor-model-parallel-size {config.tp}",
        f"--pipeline-model-parallel-size {config.pp}",
        f"--micro-batch-size {config.mbs}",
        f"--global-batch-size {config.global_batch}",
        f"--seq-length {training.seq_len}",
    ]
    if config.cp > 1:
        args.append(f"--context-parallel-size {config.cp}")
    if config.tp > 1:
        args.append("--sequence-parallel")
    if config.zero_stage == 1:
        args.append("--use-distributed-optimizer")
    if config.schedule == "interleaved":
        args.append(f"--num-layers-per-virtual-pipeline-stage {layers // (config.pp * config.virtual_stages)}")
    if config.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif config.recompute == "selective":
        args.append("--recompute-granularity selective")
    if training.dtype in ("bf16", "fp16"):
        args.append(f"--{training.dtype}")
    return (args + moe_arguments(config, moe, flex_backend) + engine_flags(config, options)
            + precision_flags(options, device_fp8, device_fp4))


#: the options priced as Transformer Engine's Megatron-Core (``pipette.stacks.MEGATRON_TE_CONSTANTS``)
TE_OPTIONS = ("te", "fp8", "mxfp8", "nvfp4")


def engine_flags(config: ParallelConfig, options: tuple[str, ...]) -> list[str]:
    """Transformer Engine as ``megatron+te`` and the FP8 recipes price it: its layers (``--transformer-impl
    transformer_engine``, Megatron-LM's default, said because forks default to ``local``) and, with tp, the
    tensor-parallel communication overlapped with the GEMMs (``--tp-comm-overlap``: TE's userbuffers; it
    needs the ``--sequence-parallel`` written with tp above). None for ``megatron`` alone, priced as vTrain's
    unfused Megatron."""
    if not any(o in options for o in TE_OPTIONS):
        return []
    return ["--transformer-impl transformer_engine"] + (["--tp-comm-overlap"] if config.tp > 1 else [])


def moe_arguments(config: ParallelConfig, moe: MoeSpec | None, flex_backend: str = "deepep") -> list[str]:
    """Megatron-Core's MoE arguments (megatron/training/arguments.py, ``_add_moe_args``) for an MoE
    model, as the megatron stack prices it: the experts' shape and routing (``--num-experts``,
    ``--moe-ffn-hidden-size``, ``--moe-router-topk``, the shared experts' width, sigmoid scores and
    group-limited routing where the model has them), the expert-parallel and expert tensor-parallel
    degrees (``--expert-tensor-parallel-size`` defaults to tp, written either way), the candidate's token
    dispatcher with grouped GEMMs: the all-to-all (Megatron's recommendation with ep; its default is
    ``allgather``) or the flex dispatcher over ``flex_backend`` (``--moe-flex-dispatcher-backend deepep`` or
    ``hybridep``), and the candidate's routing (``pipette.routing``): dropless (Megatron's default) or a
    capacity factor, padded to the capacity under the all-to-all (``--moe-pad-expert-input-to-capacity``:
    the sizes known on the device, no host sync, as priced; the flex dispatcher refuses the padding).
    Which layers are dense (``--moe-layer-freq``, a Python expression) is the model's: said in a
    comment line, not as a flag a shell would glob."""
    if moe is None:
        return []
    args = [f"--num-experts {moe.experts}", f"--moe-ffn-hidden-size {moe.expert_ffn}",
            f"--moe-router-topk {moe.top_k}"]
    if moe.shared_ffn:
        args.append(f"--moe-shared-expert-intermediate-size {moe.shared_ffn}")
    if moe.scoring == "sigmoid":
        args.append("--moe-router-score-function sigmoid")
    if moe.groups > 1:
        args += [f"--moe-router-num-groups {moe.groups}", f"--moe-router-group-topk {moe.group_top_k}"]
    args += [f"--expert-model-parallel-size {config.ep}",
             f"--expert-tensor-parallel-size {config.tp if config.etp is None else config.etp}"]
    if config.dispatcher == "flex":
        args += ["--moe-token-dispatcher-type flex", f"--moe-flex-dispatcher-backend {flex_backend}"]
    else:
        args.append("--moe-token-dispatcher-type alltoall")
    args.append("--moe-grouped-gemm")
    capacity = capacity_of(moe.capacity_factor, config.routing)
    if capacity is not None:
        args.append(f"--moe-expert-capacity-factor {capacity:g}")
        if config.dispatcher is None:
            args.append("--moe-pad-expert-input-to-capacity")
    return args


def precision_flags(options: tuple[str, ...], device_fp8: bool, device_fp4: bool) -> list[str]:
    """Transformer Engine's recipe in Megatron-LM's flags (megatron/training/arguments.py:
    ``--fp8-format``/``--fp8-recipe``, ``--fp4-format``/``--fp4-recipe``), as Megatron-Bridge's
    mixed-precision recipes set them; none where the device lacks the tensor cores the recipe needs
    (MXFP8 and NVFP4 are Blackwell's block-scaled formats: the devices with an FP4 peak)."""
    if "fp8" in options and device_fp8:  # megatron+fp8 prices FP8 weights too (MemoryOptions.fp8_weights)
        return ["--fp8-format hybrid", "--fp8-param-gather"]
    if "mxfp8" in options and device_fp4:  # Bridge's bf16_with_mxfp8_mixed: E4M3 everywhere, FP8 weights
        return ["--fp8-format e4m3", "--fp8-recipe mxfp8", "--fp8-param-gather"]
    if "nvfp4" in options and device_fp4:  # Bridge's NVFP4 recipe: E2M1 values with block scales
        return ["--fp4-format e2m1", "--fp4-recipe nvfp4"]
    return []


def megatron_args_file(training: TrainingSpec, config: ParallelConfig, layers: int, header: str,
                       options: tuple[str, ...] = (), device_fp8: bool = True, device_fp4: bool = True,
                       moe: MoeSpec | None = None, flex_backend: str = "deepep") -> str:
    """``megatron_args.txt``: the arguments after a header of ``#`` lines saying how to use them."""
    lora = ["# LoRA: these are Megatron-LM's pretraining arguments; under NeMo's PEFT give the same",
            "# degrees and batch in its trainer and model config."] if training.method == "lora" else []
    return "\n".join([
        f"# {header}",
        "# Megatron-LM pretrain_gpt.py arguments for the parallel layout and batch Pipette priced;",
        "# add your model, data and optimizer arguments, e.g.",
        "#   torchrun ... pretrain_gpt.py $(grep -v '^#' megatron_args.txt) <your arguments>",
        "# Ranks: tp fastest, then dp, then pp (Megatron-LM's default order, as in rank_map.json);",
        "# start the nodes in the hostfile's order.",
        *lora,
        *tf32_note(training),
        *_dense_layers_note(moe, layers),
        *megatron_arguments(training, config, layers, options, device_fp8, device_fp4, moe, flex_backend),
        "",
    ])


def flex_backend(link_domain_sizes: list[int], node_sizes: list[int]) -> str:
    """The flex dispatcher's backend for a cluster: ``hybridep`` where an NVLink domain spans nodes (an
    NVL72 rack of 4-GPU trays: DeepEP's normal kernels reach at most 8 NVLink peers, ``NUM_MAX_NVL_PEERS``,
    and would cross trays over RDMA; HybridEP is NVIDIA's backend for such racks, as Megatron-Bridge's GB200 /
    GB300 recipes run it), ``deepep`` otherwise."""
    return "hybridep" if max(link_domain_sizes) > max(node_sizes) else "deepep"


def _dense_layers_note(moe: MoeSpec | None, layers: int) -> list[str]:
    """The comment that names an MoE model's dense layers in ``--moe-layer-freq``'s words."""
    if moe is None or not moe.dense_layers:
        return []
    freq = [0 if i in moe.dense_layers else 1 for i in range(layers)]
    return [f"# MoE: layers {list(moe.dense_layers)} are dense: add --moe-layer-freq \"{freq}\" (quoted) to your "
            "model arguments"]


def nanotron_config(training: TrainingSpec, config: ParallelConfig, header: str) -> str:
    """``nanotron.yaml``: the keys of a nanotron config the candidate sets (YAML, flat enough to
    write without a YAML library)."""
    true, false = "true", "false"
    return "\n".join([
        f"# {header}",
        "# Merge these keys into your nanotron config (the rest: model, data, optimizer's learning rate).",
        *tf32_note(training),
        "parallelism:",
        f"  dp: {config.dp}",
        f"  pp: {config.pp}",
        f"  tp: {config.tp}",
        *([f"  context_parallel_size: {config.cp}"] if config.cp > 1 else []),
        "  pp_engine: 1f1b",
        "  tp_mode: REDUCE_SCATTER",
        f"  tp_linear_async_communication: {true if config.tp > 1 else false}",
        "  tp_recompute_allgather: true",
        f"  recompute_layer: {true if config.recompute == 'full' else false}",
        "tokens:",
        f"  sequence_length: {training.seq_len}",
        f"  micro_batch_size: {config.mbs}",
        f"  batch_accumulation_per_replica: {config.grad_accum}",
        "optimizer:",
        f"  zero_stage: {config.zero_stage}",
        "  accumulate_grad_in_fp32: true",
        "",
    ])
