"""``ScriptSpec``: the user's own training script, as Pipette tunes and launches it.

A script is an argument list (never a shell string) plus the *knobs* it accepts: the command
line flag through which it takes each setting Pipette chooses. Pipette restricts the search to
what the script can do (``ScriptSpec.refusals``), writes each candidate's DeepSpeed config on
top of the user's own (``script_ds_config``), and appends the knobs to the argument list
(``ScriptSpec.command``). Knobs:

``deepspeed_config``  the flag taking the DeepSpeed config path (HF Trainer: ``--deepspeed``)
``micro_batch``       the flag taking the micro-batch size (or none: the script reads the config)
``grad_accum``        the flag taking the gradient accumulation steps (likewise)
``checkpointing``     a flag present when activation checkpointing (full recomputation) is on
``steps``             the flag taking the number of optimizer steps to run (for a script that does
                      not listen to ``pipette.report``: it then stops by itself)
``seq_len``           the flag taking the sequence length
``bf16`` / ``fp16``   flags present when training in that precision (HF Trainer's ``--bf16``)
``fsdp``              a flag present when the candidate shards with FSDP (HF Trainer's ``--fsdp``)
``fsdp_config``       the flag taking the FSDP config file Pipette writes (HF Trainer's
                      ``--fsdp_config`` JSON)

``kind`` fills the usual knobs of a known stack (``hf-trainer``, ``deepspeed``,
``accelerate-fsdp``, ``torchtitan``); any knob can be set or cleared on top. A script that shards
with PyTorch FSDP (``fsdp``: the kinds ``accelerate-fsdp`` and ``torchtitan``, or an
``hf-trainer`` script tuned with the ``fsdp`` stack) takes the ``fsdp`` stack's candidates
(``pipette.script_fsdp``), never a DeepSpeed config. Pure: reads no file and starts nothing
(``check_script`` in the CLI and the service checks the files).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.stacks import Stack, get_stack
from pipette.training import TrainingSpec

KNOBS = ("deepspeed_config", "micro_batch", "grad_accum", "checkpointing", "steps", "seq_len", "bf16", "fp16",
         "tf32", "fsdp", "fsdp_config")
#: Knobs that are flags without a value (present when on).
SWITCHES = ("checkpointing", "bf16", "fp16", "tf32", "fsdp")

#: The knobs of the stacks Pipette knows (HF ``TrainingArguments`` names; the example loop's).
KINDS: dict[str, dict[str, str]] = {
    "hf-trainer": {
        "deepspeed_config": "--deepspeed", "micro_batch": "--per_device_train_batch_size",
        "grad_accum": "--gradient_accumulation_steps", "checkpointing": "--gradient_checkpointing",
        "steps": "--max_steps", "bf16": "--bf16", "fp16": "--fp16", "tf32": "--tf32", "fsdp": "--fsdp",
        "fsdp_config": "--fsdp_config",
    },
    "deepspeed": {"deepspeed_config": "--deepspeed_config"},
    # Accelerate's FSDP plugin reads its settings from what `accelerate launch` exports (the
    # config YAML's fsdp_config), so the script needs no config flag; these are the Trainer's
    # names, which examples/scripts/accelerate_fsdp.py takes too.
    "accelerate-fsdp": {
        "micro_batch": "--per_device_train_batch_size", "grad_accum": "--gradient_accumulation_steps",
        "steps": "--max_steps",
    },
    # torchtitan's train entry (0.3.0 torchtitan/train.py): the candidate as --section.field flags
    # (pipette.script_fsdp.torchtitan_args), the step count among them
    "torchtitan": {"steps": "--training.steps"},
}
#: What a user can say their script cannot run (``ScriptSpec.unsupported``), in words.
UNSUPPORTED = {"tp": "tensor parallelism (tp > 1)", "pp": "pipeline parallelism (pp > 1)",
               "selective": "selective recomputation", "full": "full recomputation",
               "hsdp": "HSDP (dp_shard)", "offload": "CPU offload"}
#: The kinds whose script shards with FSDP whatever the stack (an ``hf-trainer`` script does
#: when tuned with the ``fsdp`` stack).
FSDP_KINDS = ("accelerate-fsdp", "torchtitan")


@dataclass(frozen=True)
class ScriptSpec:
    #: the command that trains, as an argument list: ``["python", "train.py", "--lr", "1e-4"]``
    argv: tuple[str, ...]
    #: knob name -> the script's flag for it (see the module docstring)
    knobs: dict[str, str] = field(default_factory=dict)
    #: the script shards tensor-parallel layers with DeepSpeed AutoTP (``tensor_parallel.autotp_size``)
    autotp: bool = False
    #: the script builds a DeepSpeed ``PipelineModule`` and reads the pipeline degree from the config
    pipeline: bool = False
    #: the user's own DeepSpeed config (its optimizer, scheduler, ...), which Pipette's keys overlay
    base_config: dict[str, Any] | None = None
    #: where the script runs (its relative paths are relative to it); None: the current directory
    workdir: str | None = None
    kind: str | None = None
    #: the script shards with PyTorch FSDP (the ``fsdp`` stack's candidates): set by the kinds
    #: ``accelerate-fsdp`` and ``torchtitan``, and by ``bind_stack`` for an ``hf-trainer`` script
    fsdp: bool = False
    #: the OS user the service starts the ranks as (``workers.host.script_user``), not the
    #: service's own; None: the caller's user (the CLI). How it runs, not what it is: not in ``to_dict``
    run_as: str | None = None
    #: what the script cannot run, said by the user (``--script-unsupported tp,pp,selective``):
    #: its candidates are never tried (``UNSUPPORTED`` names each)
    unsupported: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        argv = self.argv
        if isinstance(argv, str) or not isinstance(argv, (list, tuple)):
            raise SpecError(f"is {type(argv).__name__} {argv!r}", field="script.argv",
                            fix='give the command as an argument list, e.g. ["python", "train.py", "--epochs", "1"]')
        if not argv:
            raise SpecError("is empty", field="script.argv",
                            fix='give the command that trains, e.g. ["python", "train.py"]')
        bad = [a for a in argv if not isinstance(a, str) or not a or "\x00" in a]
        if bad:
            raise SpecError(f"holds {bad[0]!r}", field="script.argv", fix="give non-empty strings only")
        if len(argv) == 1 and " " in argv[0].strip():
            raise SpecError(f"is one string with spaces {argv[0]!r}: a shell string", field="script.argv",
                            fix="split it into an argument list (no shell runs it): " + str(argv[0].split()))
        object.__setattr__(self, "argv", tuple(argv))
        if self.kind is not None and self.kind not in KINDS:
            raise SpecError(f"is {self.kind!r}", field="script.kind",
                            fix=f"use one of {', '.join(KINDS)}, or give knobs")
        knobs = dict(KINDS.get(self.kind or "", {}))
        if not isinstance(self.knobs, dict):
            raise SpecError("is not a mapping", field="script.knobs", fix="give knob: flag pairs")
        for name, flag in self.knobs.items():
            if name not in KNOBS:
                raise SpecError(f"unknown knob {name!r}", field="script.knobs", fix=f"use {', '.join(KNOBS)}")
            if flag in (None, ""):
                knobs.pop(name, None)  # cleared on top of the kind's
                continue
            if not isinstance(flag, str) or not flag.startswith("-") or " " in flag:
                raise SpecError(f"{name} is {flag!r}", field=f"script.knobs.{name}",
                                fix="give the script's flag, e.g. --per_device_train_batch_size")
            knobs[name] = flag
        object.__setattr__(self, "knobs", knobs)
        if self.base_config is not None and not isinstance(self.base_config, dict):
            raise SpecError("is not a JSON object", field="script.base_config", fix="give a DeepSpeed config")
        if not isinstance(self.fsdp, bool):
            raise SpecError(f"is {self.fsdp!r}", field="script.fsdp", fix="use true or false")
        features: list[str] = [self.unsupported] if isinstance(self.unsupported, str) else list(self.unsupported)
        bad_features = [u for u in features if u not in UNSUPPORTED]
        if isinstance(self.unsupported, str) or bad_features:
            raise SpecError(f"holds {(bad_features or features)[0]!r}", field="script.unsupported",
                            fix=f"name what the script cannot run among {', '.join(UNSUPPORTED)}, as a list")
        object.__setattr__(self, "unsupported", tuple(sorted(set(self.unsupported))))
        if self.kind in FSDP_KINDS:
            object.__setattr__(self, "fsdp", True)
        if self.fsdp:
            _check_fsdp_script(self)

    @property
    def program(self) -> str:
        """What the launchers run: the script's path when the command is ``python SCRIPT ...``."""
        return self.argv[1] if self.is_python and len(self.argv) > 1 else self.argv[0]

    @property
    def is_python(self) -> bool:
        name = self.argv[0].rsplit("/", 1)[-1]
        return name.startswith("python")

    @property
    def script_args(self) -> tuple[str, ...]:
        """The arguments after the program (``python train.py A B`` -> ``A B``)."""
        return self.argv[2:] if self.is_python else self.argv[1:]

    def refusals(self, training: TrainingSpec, config: ParallelConfig, nodes: list[int] | None = None) -> list[str]:
        """Why this script cannot run ``config``; empty when it can. ``nodes``: the node of each
        device, to check that launchers which number ranks node by node can place it."""
        said = self._unsupported_refusals(config)
        if self.fsdp:
            return said + fsdp_script_refusals(self, config) + self._node_refusals(config, nodes)
        out = said
        if config.dp_shard is not None or config.offload:
            out.append("HSDP (dp_shard) and CPU offload are FSDP options: a DeepSpeed script has neither")
        if config.ep > 1:
            out.append(f"ep={config.ep}: a DeepSpeed script's expert groups are its model code's "
                       "(deepspeed.moe.layer.MoE's ep_size), which no config Pipette writes can set")
        if config.pp > 1 and not self.pipeline:
            out.append(f"pp={config.pp}: the script does not build a PipelineModule (say pipeline: true if it does)")
        if config.tp > 1 and not self.autotp:
            out.append(f"tp={config.tp}: the script does not run DeepSpeed AutoTP (say autotp: true if it does)")
        if config.tp > 1 and training.is_lora:
            out.append(f"tp={config.tp}: PEFT LoRA adapters do not survive DeepSpeed AutoTP")
        if config.recompute == "selective":
            out.append("selective recomputation: a script checkpoints whole layers (full) or nothing")
        if config.recompute == "full" and "checkpointing" not in self.knobs:
            out.append("full recomputation: the script has no checkpointing knob")
        if config.virtual_stages > 1 or config.schedule != "1f1b":
            out.append(f"schedule {config.schedule!r}: DeepSpeed's pipeline runs 1F1B only")
        if not self.micro_batch_settable() and config.mbs != 1 and "deepspeed_config" not in self.knobs:
            out.append(f"mbs={config.mbs}: the script takes neither a DeepSpeed config nor a micro-batch knob")
        return out + self._node_refusals(config, nodes)

    def _unsupported_refusals(self, config: ParallelConfig) -> list[str]:
        """What the user said the script cannot run (``unsupported``), that ``config`` uses."""
        uses = {"tp": config.tp > 1, "pp": config.pp > 1, "selective": config.recompute == "selective",
                "full": config.recompute == "full", "hsdp": config.dp_shard is not None, "offload": config.offload}
        return [f"{UNSUPPORTED[u]}: the script does not run it (--script-unsupported {u})"
                for u in self.unsupported if uses[u]]

    @staticmethod
    def _node_refusals(config: ParallelConfig, nodes: list[int] | None) -> list[str]:
        if nodes is not None:
            order = [nodes[d] for d in config.devices()]
            blocks = 1 + sum(a != b for a, b in itertools.pairwise(order))
            if blocks != len(set(order)):
                return ["the placement interleaves nodes; launchers number a script's ranks node by node"]
        return []

    def micro_batch_settable(self) -> bool:
        return "micro_batch" in self.knobs or "deepspeed_config" in self.knobs

    def command(self, training: TrainingSpec, config: ParallelConfig, ds_config_path: str,
                steps: int | None = None, fsdp_config_path: str | None = None, device_kind: str = "gpu") -> list[str]:
        """The argument list that runs ``config``: the user's, then each knob Pipette sets. An
        FSDP script gets its FSDP switch and config file (``fsdp_config_path``) instead of the
        DeepSpeed config, and its recomputation from that config (the Trainer's
        ``fsdp_config.activation_checkpointing``, Accelerate's plugin, torchtitan's TOML). The
        ``tf32`` switch only on a GPU (``device_kind``): a CPU trains ``tf32`` as fp32, and the
        Trainer refuses ``--tf32`` without an Ampere-or-newer GPU."""
        k = self.knobs
        out = list(self.argv)
        if self.fsdp:
            if "fsdp" in k and sharded(config):
                out.append(k["fsdp"])
            if "fsdp_config" in k and fsdp_config_path is not None and (sharded(config) or self.kind == "torchtitan"):
                out += [k["fsdp_config"], fsdp_config_path]
        elif "deepspeed_config" in k:
            out += [k["deepspeed_config"], ds_config_path]
        if "micro_batch" in k:
            out += [k["micro_batch"], str(config.mbs)]
        if "grad_accum" in k:
            out += [k["grad_accum"], str(config.grad_accum)]
        if "seq_len" in k:
            out += [k["seq_len"], str(training.seq_len)]
        if "steps" in k and steps is not None:
            out += [k["steps"], str(steps)]
        recompute_by_flag = not self.fsdp or (self.kind == "hf-trainer" and not sharded(config))
        if config.recompute == "full" and "checkpointing" in k and recompute_by_flag:
            out.append(k["checkpointing"])
        if training.dtype in ("bf16", "fp16") and training.dtype in k:
            out.append(k[training.dtype])
        if training.dtype == "tf32" and "tf32" in k and device_kind == "gpu":
            out.append(k["tf32"])
        return out

    def sets_tf32(self) -> bool:
        """Whether Pipette can turn TF32 on for this script (its ``tf32`` knob); else the script must."""
        return "tf32" in self.knobs

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["argv"] = list(self.argv)
        if not self.fsdp:  # written only when set: a DeepSpeed script's dict (and its trials' key) is unchanged
            del out["fsdp"]
        del out["run_as"]
        if not self.unsupported:  # likewise: written only when said
            del out["unsupported"]
        else:
            out["unsupported"] = list(self.unsupported)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScriptSpec:
        if not isinstance(data, dict):
            raise SpecError("is not a mapping", field="script", fix="give argv and the knobs")
        known = {f.name for f in fields(cls)}
        bad = sorted(set(data) - known)
        if bad:
            raise SpecError(f"unknown key(s) {', '.join(bad)}", field="script", fix=f"use {', '.join(sorted(known))}")
        if "argv" not in data:
            raise SpecError("is missing", field="script.argv", fix='give the command, e.g. ["python", "train.py"]')
        return cls(**{k: v for k, v in data.items() if k != "knobs"}, knobs=dict(data.get("knobs") or {}))


def sharded(config: ParallelConfig) -> bool:
    """Whether an FSDP script's candidate shards (``zero_stage`` 3 ``FULL_SHARD``, 2
    ``SHARD_GRAD_OP``) rather than replicates (0: ``NO_SHARD``, which is DDP)."""
    return config.zero_stage in (2, 3)


def fsdp_script_refusals(script: ScriptSpec, config: ParallelConfig) -> list[str]:
    """Why an FSDP script of ``script.kind`` cannot run ``config`` (empty when it can): what
    Accelerate's FSDP2 plugin, the HF Trainer's ``--fsdp`` and torchtitan each take."""
    c, kind = config, script.kind
    out = []
    if c.zero_stage == 1:
        out.append("ZeRO-1 (optimizer-only sharding) is DeepSpeed's: FSDP shards with zero_stage 3, 2 or 0")
    if c.offload and not sharded(c):
        out.append(f"CPU offload with zero_stage {c.zero_stage}: FSDP offloads sharded parameters only")
    if c.dp_shard is not None and not sharded(c):
        out.append(f"dp_shard={c.dp_shard} with zero_stage {c.zero_stage} (NO_SHARD): nothing is sharded")
    if kind == "torchtitan":
        return out  # torchtitan composes FSDP2/HSDP with TP, PP (1F1B, interleaved), CP, EP and per-op selective AC
    if c.ep > 1:
        out.append(f"ep={c.ep}: {kind or 'the script'} has no expert parallelism (FSDP shards the experts as any "
                   "weight); torchtitan runs ep")
    if c.cp > 1:
        out.append(f"cp={c.cp}: {kind or 'the script'} splits sequences only inside its own loop "
                   "(Accelerate's maybe_context_parallel), which Pipette cannot see; torchtitan runs cp")
    if c.tp > 1:
        out.append(f"tp={c.tp}: {kind or 'the script'} shards with FSDP only (torchtitan composes TP with it)")
    if c.pp > 1 or c.schedule != "1f1b":
        out.append(f"pp={c.pp}: {kind or 'the script'} has no pipeline parallelism (torchtitan has)")
    if c.recompute == "selective":
        out.append("selective recomputation: Accelerate and the Trainer checkpoint whole decoder layers (full)")
    if kind == "accelerate-fsdp" and c.zero_stage == 0:
        out.append("zero_stage 0 (NO_SHARD): Accelerate's FSDP2 plugin always shards; a replicated run is DDP")
    if kind != "accelerate-fsdp" and c.dp_shard is not None:
        out.append(f"HSDP (dp_shard={c.dp_shard}): the Trainer's fsdp_config has no replicate degree")
    if c.recompute == "full" and not sharded(c) and "checkpointing" not in script.knobs:
        out.append("full recomputation without FSDP (zero_stage 0): the script has no checkpointing knob")
    if "micro_batch" not in script.knobs and c.mbs != 1:
        out.append(f"mbs={c.mbs}: the script has no micro-batch knob")
    return out


def _check_fsdp_script(script: ScriptSpec) -> None:
    """An FSDP script with a DeepSpeed-only option: one line, what and how to fix."""
    if script.kind == "deepspeed":
        raise SpecError("is deepspeed, a DeepSpeed loop, but the script is to shard with FSDP", field="script.kind",
                        fix="use --script-kind accelerate-fsdp, torchtitan or hf-trainer for an FSDP script, or "
                            "tune the DeepSpeed loop with --stack hf-deepspeed")
    for name, what in (("autotp", "DeepSpeed AutoTP"), ("pipeline", "a DeepSpeed PipelineModule")):
        if getattr(script, name):
            raise SpecError(f"is set, but {what} is DeepSpeed's and the script shards with FSDP",
                            field=f"script.{name}", fix=f"drop --script-{name}: the FSDP candidates' tp and pp come "
                            "from the stack (torchtitan runs them)")
    if script.base_config is not None and script.kind == "torchtitan":
        raise SpecError("is a job config file, but torchtitan (0.3) takes its job from --module and --config",
                        field="script.base_config", fix="drop --script-config: give --module/--config and your "
                                                        "own --section.field overrides in the command")
    if script.base_config is not None:
        raise SpecError("is a DeepSpeed config, but the script shards with FSDP", field="script.base_config",
                        fix="drop --script-config: Pipette writes the FSDP settings (Accelerate config, "
                            "--fsdp_config)")
    if script.kind == "torchtitan":
        check_torchtitan_argv(script)
    if "deepspeed_config" in script.knobs and script.kind != "hf-trainer":
        raise SpecError("is set, but the script shards with FSDP", field="script.knobs.deepspeed_config",
                        fix="clear it (--script-knob deepspeed_config=)")


#: the command line torchtitan 0.3.0's ``torchtitan.train`` requires (``ConfigManager._load_config``)
TORCHTITAN_REQUIRED = ("--module", "--config")


def check_torchtitan_argv(script: ScriptSpec) -> None:
    """torchtitan's own entry (``python -m torchtitan.train``) needs ``--module`` and
    ``--config`` (0.3.0: "--module is required"), and leaves the activation checkpointing to
    Pipette; one line when not (``SpecError``)."""
    if script.argv[1:3] != ("-m", "torchtitan.train"):
        return  # the user's own entry: its command line is its own
    given = {a.split("=", 1)[0] for a in script.argv}
    missing = [flag for flag in TORCHTITAN_REQUIRED if flag not in given]
    if missing:
        raise SpecError(f"lacks {' and '.join(missing)}: torchtitan (0.3) takes its model and job from them",
                        field="script.argv", fix="give them after --script, e.g. --script python -m torchtitan.train "
                                                 "--module llama3 --config llama3_8b")
    chosen = [a for a in script.argv if a.startswith("activation-checkpoint:")]
    if chosen:
        raise SpecError(f"holds {chosen[0]}", field="script.argv",
                        fix="drop it: Pipette chooses each candidate's activation checkpointing")


#: The script kinds that shard with FSDP when the stack says so (``bind_stack``): an unnamed kind's
#: knobs, and the HF Trainer's ``--fsdp``; the FSDP kinds shard already (``FSDP_KINDS``).
FSDP_SWITCHABLE: tuple[str | None, ...] = (None, "hf-trainer")


def bind_stack(script: ScriptSpec, stack: str | Stack) -> ScriptSpec:
    """The script as tuned with ``stack`` (a ``Stack``, or a name with its options): under a stack
    whose scripts shard with FSDP (``Stack.fsdp_scripts``: fsdp) an ``hf-trainer`` script does; a
    script kind that does not match the stack is refused in one line (``SpecError``)."""
    chosen = get_stack(stack, field="--stack")
    if chosen.fsdp_scripts and not script.fsdp:
        if script.kind not in FSDP_SWITCHABLE:
            raise SpecError(f"is {script.kind}, a DeepSpeed script, but the stack is {chosen.name}",
                            field="--script-kind", fix="tune it with --stack hf-deepspeed, or use accelerate-fsdp, "
                                                       "torchtitan or hf-trainer for an FSDP script")
        return replace(script, fsdp=True)
    if script.fsdp and not chosen.fsdp_scripts:
        raise SpecError(f"{chosen.key}: the script shards with FSDP ({script.kind or 'fsdp'}), the stack is not fsdp",
                        field="--stack", fix="use --stack fsdp (the default for accelerate-fsdp and torchtitan "
                                             "scripts), or a DeepSpeed script kind")
    return script


def script_ds_config(pipette_config: dict[str, Any], script: ScriptSpec) -> dict[str, Any]:
    """The DeepSpeed config a script trial (and the user's launch) runs: the user's
    ``base_config`` with Pipette's parallel keys on top (batch sizes, ZeRO, AutoTP, precision).

    Pipette's optimizer block is left out, so the script's own optimizer (or the base config's)
    trains: the Hugging Face Trainer refuses a config whose optimizer settings disagree with its
    arguments, and a plain loop passes its optimizer to ``deepspeed.initialize``."""
    out = copy.deepcopy(script.base_config or {})
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        out[key] = pipette_config[key]
    zero = dict(out.get("zero_optimization") or {})
    mine = pipette_config["zero_optimization"]
    if zero.get("stage") != mine["stage"]:
        # the user's ZeRO tuning belongs to the stage they set; another stage gets Pipette's
        zero = {k: v for k, v in zero.items() if k.startswith("offload")}
    out["zero_optimization"] = zero | mine
    if "tensor_parallel" in pipette_config:
        out["tensor_parallel"] = dict(out.get("tensor_parallel") or {}) | pipette_config["tensor_parallel"]
    else:
        out.pop("tensor_parallel", None)
    for precision in ("bf16", "fp16"):
        if precision in pipette_config:
            out[precision] = dict(out.get(precision) or {}) | pipette_config[precision]
        elif precision in out:
            out[precision] = dict(out[precision]) | {"enabled": False}
    out.setdefault("gradient_clipping", pipette_config.get("gradient_clipping", 1.0))
    return out
