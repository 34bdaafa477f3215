"""``pipette tune``: the main job. Measure the cluster (or reuse a fresh profile), plan, run
real trials of the most promising candidates on Ray, learn, stop, and write the winner's
launch files.

With no flags it tunes the embedded default: a local Ray, 4 CPU devices with gloo, the
``tiny-llama`` model fine-tuned with LoRA. ``--cluster`` and ``--model`` point the same
command at a real GPU cluster (``RAY_ADDRESS``).

What a job learns is kept under ``--home`` (``$PIPETTE_HOME``, default ``~/.pipette``):
profiles in ``profiles/``, trial records per cluster in ``trials/<cluster key>.jsonl``; the
next job on the same cluster starts from them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.inputs import add_option_flags, add_recipe_flags, load_model, load_recipe, option_values
from cli.signals import Terminated, exit_code, signal_name, terminate_like_interrupt
from pipette.datafiles import check_checkpoint, jsonl_token_ids
from pipette.errors import SpecError
from pipette.options import TRIAL_TIMEOUT_S
from pipette.registry import TrialKind, job_kind, stack_choice_of
from pipette.script import KINDS, KNOBS, ScriptSpec
from pipette.stack_choice import StackChoice, pricing_lines
from pipette.stacks import get_stacks

if TYPE_CHECKING:
    from pipette.cluster import ClusterProfile
    from pipette.measurement import Measurement
    from pipette.model import ModelSpec
    from pipette.plan import Plan
    from pipette.training import TrainingSpec
    from pipette.trials import JsonlTrialStore, TrialRecord, TrialStore
    from pipette.tuner import TuneEvent, TuneOptions, Tuner, TuneResult
    from workers.host.runner import RayTrialRunner

GiB = 1024**3
#: A profile younger than this is reused instead of measuring again.
PROFILE_MAX_AGE_S = 3600.0

TUNE_EXAMPLES = """\
examples:
  pipette tune                                   # the embedded default: 4 CPU devices, tiny-llama, LoRA
  pipette tune --max-trials 4 --json > result.json
  pipette tune --model examples/scripts/tiny-llama/config.json --script-kind hf-trainer \\
      --script python examples/scripts/hf_trainer_lora.py --output_dir /tmp/out --report_to none
  RAY_ADDRESS=head:6380 pipette tune --model llama2-7b --cluster my-a100s.yaml \\
      --recipe examples/recipes/llama2-7b-lora.yaml --out best-7b
"""


#: What ``tune`` takes where no --recipe is given and no flag says (``_with_defaults``; the help
#: texts are written from it); ``plan`` has none: its help says "required" or the recipe's defaults.
TUNE_DEFAULTS: dict[str, Any] = {"global_batch": 16, "seq_len": 128, "method": "lora", "lora_rank": 8,
                                 "lora_alpha": 16.0, "cpu_dtype": "fp32"}


def tune_recipe_help() -> dict[str, str]:
    """Each recipe flag's default under ``tune``, in words, from ``TUNE_DEFAULTS`` and the recipe's."""
    from cli.inputs import recipe_default

    d = TUNE_DEFAULTS
    return {
        "global_batch": f"default {d['global_batch']} without --recipe",
        "seq_len": f"default {d['seq_len']} without --recipe",
        "dtype": f"default {d['cpu_dtype']} without --recipe on the embedded CPU cluster (no --cluster); "
                 f"else {recipe_default('dtype').removeprefix('default: ')}",
        "method": f"default {d['method']} without --recipe; with one, "
                  + recipe_default("method").removeprefix("default: "),
        "lora_rank": f"default {d['lora_rank']} without --recipe; with one, "
                     + recipe_default("lora_rank").removeprefix("default: "),
        "lora_alpha": f"default {d['lora_alpha']:g} without --recipe; with one, "
                      + recipe_default("lora_alpha").removeprefix("default: "),
    }


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tune",
        help="find the fastest configuration by real trials (the main job)",
        description="Profile the cluster, plan, run short real DeepSpeed trials of the most promising "
        "candidates on Ray, learn from each, stop when no candidate is likely to beat the best, and "
        "write the best configuration's launch files.",
        epilog=TUNE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny-llama", help="a preset name or a config.json path (default tiny-llama)")
    p.add_argument("--cluster", help="a cluster file; default: measure the local machine as --devices CPU devices")
    p.add_argument("--devices", type=int, default=4, help="CPU devices of the embedded cluster (default 4)")
    p.add_argument("--reprofile", action="store_true", help="measure the cluster even if a fresh profile exists")
    add_recipe_flags(p, tune_recipe_help())
    add_option_flags(p, "tune")
    p.add_argument("--data", help="a local JSONL of prompt/response pairs, tokenised as raw UTF-8 bytes (modulo "
                   "the vocabulary), not by the model's tokenizer: the shapes and step times are those of real "
                   "text, the loss is not (default: synthetic tokens)")
    p.add_argument("--checkpoint", help="a local Hugging Face checkpoint folder (safetensors) to start from; "
                   "each rank reads only its slices (default: seeded random weights)")
    p.add_argument("--home", default=None, help="where profiles and trial records live (default $PIPETTE_HOME, "
                   "else ~/.pipette)")
    p.add_argument("--no-memory", action="store_true", help="neither read nor keep past trials of this cluster")
    p.add_argument("--out", default="pipette-best", help="where to write the best configuration's files "
                   "(default pipette-best)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress on stderr)")
    s = p.add_argument_group("your own training script", "Tune the script you train with instead of Pipette's "
                             "runner: its trials run it with each candidate's DeepSpeed config and knobs.")
    s.add_argument("--script-kind", choices=sorted(KINDS), help="the stack the script uses: fills its knobs "
                   "(hf-trainer: --deepspeed, or --fsdp/--fsdp_config with --stack fsdp, "
                   "--per_device_train_batch_size, ...; deepspeed: --deepspeed_config; accelerate-fsdp: Accelerate's "
                   "FSDP2 plugin (stack fsdp); torchtitan: --parallelism.* and --training.* flags (stack fsdp); "
                   "default: none, each knob by --script-knob)")
    s.add_argument("--script-knob", action="append", default=[], metavar="KNOB=FLAG",
                   help=f"the script's flag for a knob ({', '.join(KNOBS)}); KNOB= clears one; repeatable (default: "
                   "--script-kind's)")
    s.add_argument("--script-autotp", action="store_true", help="the script runs DeepSpeed AutoTP (tp > 1)")
    s.add_argument("--script-pipeline", action="store_true", help="the script builds a PipelineModule (pp > 1)")
    s.add_argument("--script-unsupported", metavar="WHAT", default="",
                   help="what the script cannot run, comma-separated among tp, pp, selective, full, hsdp, offload: "
                   "no candidate using it is tried (default: what its kind cannot run)")
    s.add_argument("--script-config", help="your DeepSpeed config (JSON): Pipette's keys overlay it (torchtitan "
                   "takes none: its --module/--config and flags go in the command) "
                   "(default: Pipette's keys alone)")
    s.add_argument("--workdir", help="where the script runs (default: the current directory)")
    s.add_argument("--script-shares-flags", action="store_true", help="the script takes some of Pipette's flag "
                   "names itself (--seed, ...): pass them after --script to it (default: such a flag after --script "
                   "stops the tune before measuring)")
    s.add_argument("--script", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the command that trains, as words, after every other flag: "
                   "--script python train.py --output_dir out (default: Pipette's own runner)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from pipette.trials import JsonlTrialStore
    from pipette.tuner import Tuner, cluster_key

    job = _read_job(args)
    ui = Progress(job.options.max_trials, stream=sys.stderr)
    pricing = pricing_lines(job.choice)
    for line in pricing:  # never another framework's prices silently (issue 45): said first
        ui.say(line)
    from pipette.registry import check_job_runs

    hints = {"script_hint": "--script", "plan_hint": "`pipette plan`"}
    check_job_runs(job.model, job.training, None, job.kind.script, **hints)  # before any measuring
    cluster = _cluster(args, job.home, ui, job.model)
    check_job_runs(job.model, job.training, cluster.device_spec.kind, job.kind.script, **hints)  # fp16 on CPUs
    plan = _plan_job(job, cluster, ui)
    # A script's trials measure the script: they are kept apart from the runner's. Read before
    # Ray starts: a store it cannot read is refused at once.
    suffix = job.kind.store_suffix(_script_key)
    store = None if args.no_memory else JsonlTrialStore(job.home / "trials" / f"{cluster_key(plan)}{suffix}.jsonl")
    prior = store.records() if store is not None else []
    from workers.host.ray_cluster import check_devices, ensure_ray

    ensure_ray()
    check_devices(cluster)  # GPUs in the file where Ray has none (or the reverse): refused before any trial
    # Every rank of this job carries a tag, so an operator (or a test) can find them: `ps e`.
    tag = os.environ.get("PIPETTE_RANK_TAG") or f"tune-{uuid.uuid4().hex[:12]}"
    stop = StopSignal(ui)
    runner = _trial_runner(args, job, cluster, ui, stop, tag)
    tuner = Tuner(plan, job.options, prior=prior, runnable=runner.refusals)
    _say_candidates(ui, plan, tuner, job.kind, prior, store)
    result = _run_trials(runner, tuner, ui, store, stop, tag)
    files = _write_best(args.out, job.kind, result)
    if args.json:
        _print_result_json(result, files, cluster, plan, pricing)
    else:
        _print_result(result, args.out, files)
    if result.interrupted:
        return exit_code(stop.signum if stop.signum is not None else signal.SIGINT)
    return 0 if result.best is not None else 1


@dataclass(frozen=True)
class TuneJob:
    """The job ``pipette tune`` is asked to tune, read from its flags and checked before anything
    is measured."""

    model: ModelSpec
    training: TrainingSpec
    options: TuneOptions
    #: steps per trial (0: the runner's default)
    steps: int
    #: a trial's timeout (seconds)
    timeout: float
    #: the memory safety margin of the plan
    margin: float
    #: where profiles and trial records live
    home: Path
    choice: StackChoice
    #: Pipette's runner or the user's script, and its stacks (``pipette.registry``)
    kind: TrialKind


def _read_job(args: argparse.Namespace) -> TuneJob:
    """The job's own inputs before measuring anything: a bad one would fail every trial (and
    charge the candidates for it)."""
    from pipette.plan import DEFAULT_MARGIN, check_recipe
    from pipette.tuner import TuneOptions

    if args.devices < 1:
        raise SpecError(f"is {args.devices}", field="--devices", fix="give 1 or more")
    given = option_values(args, "tune")
    options = TuneOptions.from_values(given)  # a reserve of max_trials: named by its flag (inputs.as_flags)
    steps = int(given["steps"] or 0)
    timeout = TRIAL_TIMEOUT_S if given["trial_timeout_s"] is None else float(given["trial_timeout_s"])
    margin = DEFAULT_MARGIN if given["margin"] is None else float(given["margin"])
    model = load_model(args.model)
    training = load_recipe(args.recipe, _with_defaults(args))
    home = Path(args.home or os.environ.get("PIPETTE_HOME") or Path.home() / ".pipette")
    check_recipe(model, training)
    if args.data:
        jsonl_token_ids(args.data, model.vocab, training.seq_len)
    if args.checkpoint:
        check_checkpoint(model, args.checkpoint)
    # Runner or script, which stacks: the registry's answer, refused here before measuring.
    script = _script(args)
    choice = stack_choice(args, script)
    kind = job_kind(choice.stack, script, field="--stack")
    from workers.host.script_trial import check_script

    check_script(kind.script)
    return TuneJob(model, training, options, steps, timeout, margin, home, choice, kind)


def _plan_job(job: TuneJob, cluster: ClusterProfile, ui: Progress) -> Plan:
    """The job's plan on ``cluster``, for its stacks."""
    from pipette.plan import make_plan

    model, training = job.model, job.training
    ui.say(f"planning {model.name} ({training.method}, global batch {training.global_batch} x {training.seq_len}) "
           f"on {cluster.world} x {cluster.device_spec.name}, stack {','.join(s.key for s in job.kind.stacks)} ...")
    return make_plan(model, training, cluster, margin=job.margin, seed=job.options.seed, stack=job.kind.stacks)


def _trial_runner(args: argparse.Namespace, job: TuneJob, cluster: ClusterProfile, ui: Progress, stop: StopSignal,
                  tag: str) -> RayTrialRunner:
    """The runner of the job's trials on Ray: each rank tagged ``tag``, stopped by ``stop``, its
    notes and phases shown by ``ui``."""
    from workers.host.runner import RayTrialRunner

    return RayTrialRunner(job.model, job.training, cluster, device_kind=cluster.device_spec.kind,
                          timeout_s=job.timeout, max_steps=job.steps, seed=job.options.seed, data=args.data,
                          checkpoint=args.checkpoint, script=job.kind.script,
                          ship_workdir=bool(os.environ.get("RAY_ADDRESS")), stack=job.kind.runner_stack,
                          env={"PIPETTE_RANK_TAG": tag}, should_stop=stop.is_set, on_note=ui.say,
                          on_phase=ui.phase)


def _say_candidates(ui: Progress, plan: Plan, tuner: Tuner, kind: TrialKind, prior: list[TrialRecord],
                    store: JsonlTrialStore | None) -> None:
    """How many candidates the trials choose among, and what the tuner starts from."""
    runs = kind.runs
    unsure = sum(not p.sure_to_fit for p in tuner.candidates)
    near = f" ({unsure} next to the memory limit, tried as their chance to fit earns)" if unsure else ""
    ui.say(f"{plan.enumerated} candidates, {len(plan.ranked)} may fit, {len(tuner.candidates)} runnable by {runs}{near}"
           + (f"; learning from {len(prior)} earlier trials on this cluster" if prior else ""))
    hint = kind.forget_hint(store.path) if prior and store is not None else None
    if hint:  # how to forget them (issue 43, item 25)
        ui.say(hint)
    for note in plan.calibration_notes:  # the trials measure; the order they come in is the model's
        ui.say(f"not calibrated here: {note}")


def _run_trials(runner: RayTrialRunner, tuner: Tuner, ui: Progress, store: TrialStore | None, stop: StopSignal,
                tag: str) -> TuneResult:
    """The trials, each shown and kept as it ends, until the stop rule or a signal stops them."""
    runner.prepare()  # DeepSpeed's CPU op where the job's stack uses it, outside any trial's timeout
    ui.header()
    terminate_like_interrupt()  # ensure_ray installed Ray's handler (exit 15, silently)
    from cli.interference import Interference

    interference = Interference(tag)
    with stop.installed():
        result = tuner.run(runner, on_event=lambda e: _on_event(e, ui, store, interference), should_stop=stop.is_set)
    result.interference = interference.summary()
    if stop.signum is not None:
        abandoned = result.interrupted  # a second signal: the tuner dropped the running trial
        result.interrupted = True
        result.stop_reason = f"interrupted ({signal_name(stop.signum)}); " + (
            "the running trial was abandoned, not recorded" if abandoned else
            "the running trial was stopped, what it measured is kept")
    ui.done(result.stop_reason)
    return result


def _write_best(out: str, kind: TrialKind, result: TuneResult) -> dict[str, str]:
    """The best configuration's launch files in ``out`` (none without a best), by name."""
    if result.best is None:
        return {}
    try:
        return {k: str(v) for k, v in kind.write_best(out, result).items()}
    except OSError as e:
        raise SpecError(f"cannot write {out!r} ({e.strerror})", field="--out", fix="give a writable folder") from None


def _print_result_json(result: TuneResult, files: dict[str, str], cluster: ClusterProfile, plan: Plan,
                       pricing: list[str]) -> None:
    """``--json``: the result, its files, the cluster, the stack and its pricing lines, on stdout."""
    from pipette.result_text import result_dict

    out = result_dict(result)
    out["files"] = files
    out["cluster"] = {"name": cluster.name, "devices": cluster.world, "measured_at": cluster.measured_at}
    out["stack"] = plan.stack_key
    out["pricing"] = pricing
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


class StopSignal:
    """Ctrl-C or SIGTERM during the trials asks the tuner to stop: the running trial is stopped
    and kept (as pruned), then the best so far and its files (the JSON with ``--json``) are
    written. A flag, not an exception, so that no library between here and the trial can
    swallow it; a second signal abandons at once."""

    def __init__(self, ui: Progress) -> None:
        self.ui = ui
        self.signum: int | None = None
        self.event = threading.Event()

    def is_set(self) -> bool:
        return self.event.is_set()

    def __call__(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        self.signum = signum
        self.event.set()
        self.ui.say(f"interrupted ({signal_name(signum)}): stopping the running trial; "
                    f"{signal_name(signum)} again to abandon it")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def stack_choice(args: argparse.Namespace, script: ScriptSpec | None) -> StackChoice:
    """The stack named, else the one the script names (its kind, or a launch file one framework
    reads among its words or its config), else the default (``pipette.stack_choice``)."""
    if args.stack:
        get_stacks(args.stack, field="--stack")  # one that does not exist: refused naming the flag
    return stack_choice_of(args.stack, script, args.script_config)


def _script(args: argparse.Namespace) -> ScriptSpec | None:
    """The user's script from the flags (None: Pipette's runner); bad flags are refused here."""
    given = [n for n in ("script_kind", "script_config", "workdir") if getattr(args, n)] + \
        (["script_knob"] if args.script_knob else []) + \
        [n for n in ("script_autotp", "script_pipeline", "script_unsupported") if getattr(args, n)]
    if args.script is None:
        if given:
            raise SpecError("needs --script", field="--" + given[0].replace("_", "-"),
                            fix="give the command after --script, last: --script python train.py ...")
        return None
    if not args.script:
        raise SpecError("is empty", field="--script", fix="give the command that trains: --script python train.py")
    _refuse_pipette_flags(args.script, args.script_shares_flags)
    knobs: dict[str, str] = {}
    for item in args.script_knob:
        name, sep, flag = item.partition("=")
        if not sep:
            raise SpecError(f"is {item!r}", field="--script-knob", fix="give KNOB=FLAG, e.g. steps=--max_steps")
        knobs[name.strip()] = flag.strip()
    base = None
    if args.script_config and args.script_kind == "torchtitan":
        base = _torchtitan_toml(args.script_config)
    elif args.script_config:
        from pipette.textfile import read_text

        try:
            base = json.loads(read_text(args.script_config, field="--script-config", what="a DeepSpeed config"))
        except json.JSONDecodeError as e:
            raise SpecError(f"{args.script_config} is not JSON ({e.msg} at line {e.lineno})",
                            field="--script-config", fix="give a DeepSpeed config file (JSON)") from None
    workdir = str(Path(args.workdir or ".").resolve())
    unsupported = tuple(w.strip() for w in args.script_unsupported.split(",") if w.strip())
    return ScriptSpec(argv=tuple(args.script), knobs=knobs, autotp=args.script_autotp, pipeline=args.script_pipeline,
                      base_config=base, workdir=workdir, kind=args.script_kind, unsupported=unsupported)


def _torchtitan_toml(path: str) -> dict[str, Any]:
    """The user's torchtitan job config (TOML), which Pipette's sections overlay."""
    import tomllib

    from pipette.textfile import read_text

    try:
        return tomllib.loads(read_text(path, field="--script-config", what="a torchtitan job config"))
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path} is not TOML ({e})", field="--script-config",
                        fix="give torchtitan's job config file (TOML)") from None


def pipette_flags_in(words: list[str]) -> tuple[list[str], list[str]]:
    """The words after ``--script`` split into ``pipette tune``'s own flags (``--flag``, with its
    value when it takes one, or ``--flag=value``) and the rest, the script's command."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    actions = sub.choices["tune"]._option_string_actions
    ours: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        action = actions.get(word.split("=", 1)[0]) if word not in ("-h", "--help") else None
        takes = 0 if action is None or "=" in word or action.nargs == 0 else 1
        (ours if action is not None else rest).extend(words[i:i + 1 + takes])
        i += 1 + takes
    return ours, rest


def _refuse_pipette_flags(words: list[str], shared: bool) -> None:
    """Pipette's flags written after ``--script`` go to the script: first they went silently (a job
    of 7.6 minutes on the defaults, every trial failed: issue 32, item 10), then with a warning and
    the tune still ran (210 s of trials ending in the script's own argument error: issue 43, item 16).
    So the tune stops before measuring, with the command as it should read; a script that takes a
    flag of the same name itself (--seed) says so with ``--script-shares-flags``."""
    ours, rest = pipette_flags_in(words)
    if not ours or shared:
        return
    flags = [w.split("=", 1)[0] for w in ours if w.startswith("-")]
    raise SpecError(
        f"is followed by Pipette's own {', '.join(flags)}, which would go to your script, not to Pipette "
        "(everything after --script is the script's command)", field="--script",
        fix=f"put them before --script: pipette tune ... {shlex.join(ours)} --script {shlex.join(rest)}; if your "
            "script takes them itself, add --script-shares-flags before --script")


def _script_key(script: ScriptSpec) -> str:
    """The script's records' key: its settings and its files' content, so that a fixed script
    starts afresh (``workers.host.script_content``)."""
    from workers.host.script_content import script_content_key

    return script_content_key(script)


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The embedded default recipe where neither a recipe file nor a flag says otherwise."""
    if args.recipe:
        return args
    args = argparse.Namespace(**vars(args))
    d = TUNE_DEFAULTS
    args.global_batch = args.global_batch or d["global_batch"]
    args.seq_len = args.seq_len or d["seq_len"]
    args.method = args.method or d["method"]
    if args.method == "lora":  # one default rank and alpha, whether LoRA was asked for or defaulted
        args.lora_rank = args.lora_rank or d["lora_rank"]
        args.lora_alpha = args.lora_alpha or d["lora_alpha"]
    if args.dtype is None and not args.cluster:
        args.dtype = d["cpu_dtype"]  # CPU devices: bf16 matmuls are emulated and slower there
    return args


def _cluster(args: argparse.Namespace, home: Path, ui: Progress, model: Any) -> Any:
    from pipette.clusterfile import cluster_from_dict, load_cluster
    from workers.host.ray_cluster import ensure_ray

    if args.cluster:
        return load_cluster(args.cluster)  # Ray starts after planning: a job that fits nowhere needs none
    path = home / "profiles" / f"local-cpu-{args.devices}.json"
    ensure_ray()
    terminate_like_interrupt()  # Ray's own handler exits 15 without a word
    if path.exists() and not args.reprofile:
        try:
            data = json.loads(path.read_text())
            age = time.time() - datetime.fromisoformat(data["measured_at"]).timestamp()
            if age < PROFILE_MAX_AGE_S:
                ui.say(f"reusing the profile measured {age / 60:.0f} min ago ({path}; --reprofile to measure again)")
                return cluster_from_dict(data, default_name=path.stem)
        except (ValueError, KeyError, OSError):
            pass  # unreadable or old: measure again
    from workers.host.probe import probe_cluster

    ui.say(f"measuring the local cluster: {args.devices} CPU devices (links, memory, compute) ...")
    start = time.monotonic()
    cluster = probe_cluster(name=f"local-cpu-{args.devices}", cpu_devices_per_node=args.devices, model=model)
    ui.say(f"profiled in {time.monotonic() - start:.1f} s: {_links_summary(cluster)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cluster.to_dict()))
    return cluster


def _links_summary(cluster: Any) -> str:
    import numpy as np

    n = cluster.world
    if n < 2:
        return "one device"
    off = cluster.bandwidth[~np.eye(n, dtype=bool)]
    return (f"link bandwidth {off.min() / 1e9:.2f}-{off.max() / 1e9:.2f} GB/s, "
            f"memory {cluster.min_usable_memory / GiB:.1f} GiB per device")


def _on_event(event: TuneEvent, ui: Progress, store: TrialStore | None, interference: Any = None) -> None:
    if event.kind == "trial_started" and event.trial is not None:
        ui.start(event.trial, event.data)
        if interference is not None:
            interference.start()
    elif event.kind == "trial_step":
        ui.step(event.data)
    elif event.kind == "trial_ended":
        if interference is not None:
            interference.end()
        from pipette.trials import TrialRecord

        record = event.record if event.record is not None else TrialRecord.from_dict(event.data)
        ui.end(record)
        if store is not None:
            store.append(record)


#: lines of a failed trial's reason shown under its line (the whole of it is in the record)
REASON_LINES = 40


def _reason_lines(m: Measurement) -> list[str]:
    """The whole reason a trial failed, not its first line cut at 160 characters; and the end
    of what its rank said, where the reason does not already hold it (a timeout)."""
    error = m.error
    lines = [x for x in error.splitlines() if x.strip()]
    said = [x for x in m.details.output_tail.splitlines() if x.strip()]
    if said and said[-1] not in error:
        lines += ["its output ended with:", *("  " + x for x in said[-10:])]
    if len(lines) > REASON_LINES:
        cut = len(lines) - REASON_LINES
        lines = [lines[0], f"... {cut} lines more in the trial's record (--home trials/*.jsonl) ...",
                 *lines[cut + 1:]]
    return lines


def _peak_text(m: Measurement) -> str:
    """The tensors' peak in MiB; a script trial on CPU has none, its ranks' peak RSS stands in."""
    if m.peak_memory_max is not None:
        return f"{m.peak_memory_max / 2**20:.0f}"
    rss = [x for x in m.details.peak_rss_bytes if x]
    return f"{max(rss) / 2**20:.0f} RSS" if rss else "-"


#: how a trial's line says why it ran, beside the search's own proposals
_PURPOSE = {"retime": " (re-time)", "retry": " (retry)"}


def _trial_label(label: str, attempt: int, purpose: str) -> str:
    """A trial's candidate as its progress lines name it: with its attempt after the first, and why it ran
    where it was not the search's own proposal."""
    return label + (f" (attempt {attempt})" if attempt > 1 else "") + _PURPOSE.get(purpose, "")


class Progress:
    """Progress on stderr: one line per trial, and a live bar on a terminal."""

    def __init__(self, total: int, stream: Any) -> None:
        self.total, self.stream = total, stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.done_trials = 0
        self.best: float | None = None
        self.best_label = ""
        self.current = ""
        self.steps = 0
        #: the running trial's phase (``workers.phases``) and seconds since its ranks started
        self.where = ""
        self.start_time = time.monotonic()

    def _c(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.tty else text

    def say(self, text: str) -> None:
        self._clear()
        print(text, file=self.stream, flush=True)

    def header(self) -> None:
        # "vs pred": (measured - predicted) / predicted, + when slower than predicted (the API's
        # prediction_error); "peak MiB": the tensors' peak (the allocator's on a GPU), or "N RSS":
        # a CPU script trial's resident peak, where no tensor peak is measured
        self.say(f"{'trial':>5}  {'candidate':<38} {'status':<8} {'predicted':>10} {'measured':>10} "
                 f"{'vs pred':>7} {'peak MiB':>9}")

    def start(self, number: int, data: dict[str, Any]) -> None:
        self.current = f"#{number} {_trial_label(data['label'], data['attempt'], str(data.get('purpose')))}"
        self.steps = 0
        self.where = ""
        self._bar()

    def step(self, data: dict[str, Any]) -> None:
        self.steps += 1
        self._bar()

    def phase(self, phase: str, elapsed: float) -> None:
        """The running trial's ranks are in ``phase``, ``elapsed`` s after they started."""
        from workers.phases import WORDS

        shown = f"step {self.steps}" if phase in ("warmup", "steps") else WORDS.get(phase, phase)
        self.where = f"{shown}, {elapsed:.0f} s"
        self._bar()

    def end(self, r: TrialRecord) -> None:
        from pipette.tuner import how_it_ended

        m = r.measurement
        status = how_it_ended(m)  # "interrupted", not "pruned", for a trial a signal stopped
        colour = {"ok": "32", "oom": "31", "failed": "31", "timeout": "33", "pruned": "33",
                  "interrupted": "33"}.get(status, "0")
        measured = f"{m.step_time:.3f} s" if m.step_time else "-"
        error = f"{r.error_pct:+.0f}%" if r.error_pct is not None else ""
        peak = _peak_text(m)
        if status == "ok" and m.step_time and (self.best is None or m.step_time < self.best):
            self.best, self.best_label = m.step_time, r.label
        self.done_trials = r.number + 1
        label = _trial_label(r.label, r.attempt, r.purpose)
        self.say(f"{'#' + str(r.number):>5}  {label:<38} {self._c(f'{status:<8}', colour)} "
                 f"{r.predicted_step_time:>8.3f} s {measured:>10} {error:>7} {peak:>9}")
        if status not in ("ok", "pruned", "interrupted") and m.error:
            for line in _reason_lines(m):
                self.say(f"       {line}")
        not_retried = r.details.not_retried
        if not_retried:
            self.say(f"       not retried: {not_retried}")

    def done(self, reason: str) -> None:
        self.say(f"stopped after {time.monotonic() - self.start_time:.0f} s: {reason}")

    def _bar(self) -> None:
        if not self.tty:
            return
        width = 24
        filled = int(width * min(self.done_trials, self.total) / self.total)
        best = f"best {self.best:.3f} s/step" if self.best else "no result yet"
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done_trials}/{self.total} trials, {best}; "
                f"running {self.current}, {self.where or f'step {self.steps}'}")
        self.stream.write("\r\033[K" + line[:200])
        self.stream.flush()

    def _clear(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")


def _print_result(result: Any, out: str, files: dict[str, str]) -> None:
    """The tune's result in text: the verdict first, the pick, its estimates against its trials, the files."""
    from pipette.result_text import (
        confidence_lines,
        degrees,
        interrupted_first,
        placement_line,
        precision_line,
        verdict_first,
        what_happened,
    )

    print()
    if result.best is None:
        print(f"no configuration succeeded ({result.stop_reason}); see the trials' errors above")
        print(f"  {what_happened(result)}")
        return
    for line in interrupted_first(result) + verdict_first(result):  # before anything that reads like a result
        print(line)
    b = result.best
    cfg = b.config
    print(f"{'best so far' if not result.decided or result.interrupted else 'best'}: {b.label}")
    layout = " ".join(f"{k}={v}" for k, v in degrees(cfg.to_dict()))  # cp and ep only when not 1
    print(f"  {layout} micro-batch={cfg.mbs} grad-accum={cfg.grad_accum} "
          f"ZeRO-{cfg.zero_stage} recompute={cfg.recompute} schedule={cfg.schedule}")
    print(f"  {placement_line(cfg)}")
    _print_measured(result)
    print(f"  {what_happened(result)}")
    for line in confidence_lines(result):
        print(f"  {line}")
    precision = precision_line(result)
    if precision:
        print(f"  {precision}")
    if files:
        _print_result_files(result, out, files)


def _print_measured(result: Any) -> None:
    """The pick's predicted and measured step time, tokens/s and peak memory, side by side."""
    b = result.best
    m = b.measurement
    n = result.pick_trials or 1
    measured = result.pick_step_time or m.step_time
    print(f"  {'':<18}{'predicted':>12}{'measured':>12}")
    print(f"  {'step time (s)':<18}{b.predicted_step_time:>12.4f}{measured:>12.4f}"
          + (f"   (geometric mean of its {n} ok trials, as it was picked)" if n > 1 else ""))
    print(f"  {'tokens/s':<18}{b.perf.tokens_per_s * b.perf.step_time / b.predicted_step_time:>12,.0f}"
          f"{result.plan.training.tokens_per_step / measured:>12,.0f}")
    if m.peak_memory:
        # Like with like: the tensors the estimator counts against the tensors the trial held;
        # the process's resident size (interpreter, libraries) beside them.
        tensors = b.memory.live_bytes
        print(f"  {'peak tensors (MiB)':<18}{tensors / 2**20:>12,.0f}{max(m.peak_memory) / 2**20:>12,.0f}")
        rss = b.details.peak_rss_bytes
        if rss:
            print(f"  {'peak RSS (MiB)':<18}{'':>12}{max(rss) / 2**20:>12,.0f}")
    headroom = result.memory_headroom()
    if headroom is not None:
        print(f"  {'memory':<18}{headroom['text']}")


def _print_result_files(result: Any, out: str, files: dict[str, str]) -> None:
    """The files written for the pick, and how to launch it: Pipette's launch.sh, or the user's script."""
    from pipette.emit import launch_sh_lines
    from pipette.emit_script import per_node_launch_lines

    print(f"\nfiles in {out}/: {', '.join(sorted(Path(f).name for f in files.values()))}")
    if "launch.sh" in files:
        print("\n".join(launch_sh_lines(out, result.best.config, result.plan.cluster)))
        return
    launches = sorted(Path(f).name for f in files.values() if Path(f).name.startswith("launch-"))
    said = {"ds_config.json": "HF Trainer: --deepspeed", "fsdp_config.json": "HF Trainer: --fsdp --fsdp_config",
            "torchtitan.toml": "torchtitan: --job.config_file",
            "accelerate_config.yaml": "accelerate launch --config_file"}
    hint = next((f"{said[n]} {out}/{n}" for n in said if any(Path(f).name == n for f in files.values())), "")
    print(f"launch your script: {' or '.join(f'{out}/{n}' for n in launches)}" + (f" ({hint})" if hint else ""))
    for line in per_node_launch_lines(out, result.best.config, result.plan.cluster, launches[0]):
        print(line)
