"""Stacks (pipette.stacks): the registry, --stack on plan and tune, make_plan per stack, the job
key and trial records per stack, the emitted files."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.emit import write_launch_files
from pipette.errors import InfeasibleError, SpecError
from pipette.fits import CPU, FSDP_GPU, MEGATRON_GPU, NANOTRON_GPU, PIPETTE_GPU
from pipette.measurement import Measurement
from pipette.memory import DEFAULT_OPTIONS, MEGATRON_OPTIONS, NANOTRON_OPTIONS, estimate_memory
from pipette.model import ModelSpec
from pipette.perf import HF_DEEPSPEED_CONSTANTS, MEGATRON_CONSTANTS, PerfModel, estimate_perf
from pipette.plan import Plan, make_plan
from pipette.stacks import FSDP, MEGATRON, NANOTRON, PIPETTE, STACK_RULES, STACKS, get_stack, runner_stacks
from pipette.training import TrainingSpec
from pipette.tuner import TrialRecord, Tuner, job_key

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "examples" / "clusters"
MODEL = ModelSpec.preset("llama2-7b")
TRAINING = TrainingSpec(global_batch=64, seq_len=4096)
A100S = homogeneous_cluster("A100-80GB", 2, 8, 300e9, 25e9)


# ---- the registry ---------------------------------------------------------------------

def test_the_registry_holds_the_five_stacks_with_their_own_models() -> None:
    assert list(STACKS) == ["pipette", "hf-deepspeed", "megatron", "nanotron", "fsdp"]
    assert get_stack(None) is PIPETTE and get_stack("pipette") == PIPETTE
    assert PIPETTE.constants is HF_DEEPSPEED_CONSTANTS and PIPETTE.memory_options is DEFAULT_OPTIONS
    # Megatron's constants; its packed fine-tuning sequences attend within each document (THD)
    assert MEGATRON.constants == replace(MEGATRON_CONSTANTS, varlen_attention=True)
    assert MEGATRON.memory_options is MEGATRON_OPTIONS
    # nanotron: Megatron's step-time constants, its own memory and prior (both fitted on Ultra-Scale)
    assert NANOTRON.constants is MEGATRON_CONSTANTS and NANOTRON.memory_options is NANOTRON_OPTIONS
    assert PIPETTE.fits_prior("gpu") is PIPETTE_GPU and MEGATRON.fits_prior("gpu") is MEGATRON_GPU
    assert NANOTRON.fits_prior("gpu") is NANOTRON_GPU and MEGATRON_GPU is not NANOTRON_GPU
    assert FSDP.fits_prior("gpu") is FSDP_GPU  # fitted on torchtitan (docs/models.md)
    assert all(s.fits_prior("cpu") is CPU for s in STACKS.values())
    assert runner_stacks() == ["pipette", "fsdp"]
    assert get_stack(FSDP) is FSDP  # an object is taken as is


def test_options_are_part_of_the_name_and_only_where_the_stack_has_them() -> None:
    assert get_stack(" FSDP+compile+fp8 ").key == "fsdp+compile+fp8"
    assert get_stack("megatron+fp8").options == ("fp8",)
    with pytest.raises(SpecError) as e:
        get_stack("megatron+compile")
    assert e.value.field == "stack" and "megatron+fp8" in str(e.value.fix)


def test_megatron_te_is_the_fp8_recipes_engine_in_the_training_dtype() -> None:
    """``megatron+te`` prices Megatron-Core with Transformer Engine in bf16 (what Megatron-Bridge runs as
    its BF16 recipe): the FP8 recipes' engine (fused attention, TP overlap, sequence parallelism, the
    devices' tensor-rate shares) without FP8 GEMMs; with a recipe the recipe's constants."""
    te, fp8 = get_stack("megatron+te").constants, get_stack("megatron+fp8").constants
    assert not te.fp8_gemms and te.fp8_efficiency == 1.0 and not te.fp8_casts_fused
    assert replace(fp8, fp8_gemms=False, fp8_casts_fused=False, fp8_efficiency=1.0) == te
    assert get_stack("megatron+fp8+te").constants == fp8
    assert get_stack("megatron").constants != te
    # at a long sequence the unfused attention of ``megatron`` alone costs: te is faster on the same layout
    cfg = ParallelConfig(tp=2, pp=1, dp=8, mbs=1, zero_stage=1, global_batch=64)
    long = TrainingSpec(global_batch=64, seq_len=8192)
    assert estimate_perf(MODEL, long, cfg, A100S, stack="megatron+te").step_time < \
        estimate_perf(MODEL, long, cfg, A100S, stack="megatron").step_time
    with pytest.raises(SpecError) as e:
        get_stack("fsdp+te")
    assert "fsdp has no option 'te'" in str(e.value)


def test_an_unknown_stack_names_the_known_ones() -> None:
    with pytest.raises(SpecError) as e:
        get_stack("deepspeed-chat")
    assert e.value.field == "stack"
    assert e.value.fix == "use one of pipette, hf-deepspeed, megatron, nanotron, fsdp"


def test_a_stack_refuses_what_it_cannot_run() -> None:
    cfg = ParallelConfig(tp=1, pp=2, dp=8, mbs=1, zero_stage=1, global_batch=64, schedule="interleaved",
                         virtual_stages=2)
    assert PIPETTE.refusals(cfg) == ["stack_schedule"]  # DeepSpeed's pipeline engine: 1F1B only
    assert MEGATRON.refusals(cfg) == []
    assert FSDP.refusals(cfg) == ["stack_zero"]  # FSDP has no ZeRO-1 mode
    assert NANOTRON.refusals(cfg) == ["stack_schedule"]  # nanotron's pipeline engine: no interleaving
    assert NANOTRON.refusals(replace(cfg, schedule="1f1b", virtual_stages=1, recompute="selective")) \
        == ["stack_recompute"]  # whole layers only (recompute_layer)
    assert set(STACK_RULES) >= {"stack_tp", "stack_pp", "stack_zero", "stack_schedule", "stack_recompute"}


# ---- the Python API -------------------------------------------------------------------

def test_a_stack_estimates_with_its_own_constants_and_options() -> None:
    cfg = ParallelConfig(tp=2, pp=1, dp=8, mbs=1, zero_stage=1, global_batch=64)
    for stack in STACKS.values():
        by_name = estimate_perf(MODEL, TRAINING, cfg, A100S, stack=stack.name)
        direct = PerfModel(MODEL, TRAINING, cfg, A100S, constants=stack.constants).estimate()
        assert by_name.step_time == estimate_perf(MODEL, TRAINING, cfg, A100S, stack=stack).step_time
        assert by_name.step_time == direct.step_time
        assert by_name.step_time == estimate_perf(MODEL, TRAINING, cfg, A100S, constants=stack.constants).step_time
        mem = estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3, stack=stack.name)
        assert mem == estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3, options=stack.memory_options)
    # the models' own defaults are Pipette's runner's, the default stack
    assert estimate_perf(MODEL, TRAINING, cfg, A100S).step_time == \
        estimate_perf(MODEL, TRAINING, cfg, A100S, stack=get_stack("pipette")).step_time
    assert estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3) == \
        estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3, stack=get_stack(None))
    with pytest.raises(SpecError, match="unknown stack"):
        get_stack("nope")


def test_the_estimators_take_a_stack_by_name_and_refuse_an_unknown_one_or_two_answers() -> None:
    """``estimate_perf(..., stack=)`` and ``estimate_memory(..., stack=)`` (issue 28's Python API): a
    name with options prices as ``get_stack`` builds it; an unknown name is one line naming the known
    ones; a stack and explicit constants or options together are refused, not silently merged."""
    cfg = ParallelConfig(tp=2, pp=1, dp=8, mbs=1, zero_stage=1, global_batch=64)
    h100 = homogeneous_cluster("H100-80GB", 2, 8, 450e9, 50e9, name="h100s")
    fp8 = get_stack("megatron+fp8")
    assert estimate_perf(MODEL, TRAINING, cfg, h100, stack="megatron+fp8").step_time \
        == PerfModel(MODEL, TRAINING, cfg, h100, constants=fp8.constants).estimate().step_time
    assert estimate_perf(MODEL, TRAINING, cfg, h100, stack="megatron+fp8").step_time \
        < estimate_perf(MODEL, TRAINING, cfg, h100, stack="megatron").step_time
    assert estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3, stack="megatron+fp8") \
        == estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3, options=fp8.memory_options)
    for call in (lambda: estimate_perf(MODEL, TRAINING, cfg, h100, stack="deepspeedy"),
                 lambda: estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3, stack="deepspeedy")):
        with pytest.raises(SpecError) as e:
            call()
        assert e.value.field == "stack" and "pipette, hf-deepspeed, megatron, nanotron, fsdp" in str(e.value)
    with pytest.raises(SpecError, match="both a stack and constants"):
        estimate_perf(MODEL, TRAINING, cfg, h100, stack="megatron", constants=fp8.constants)
    with pytest.raises(SpecError, match="both a stack and memory options"):
        estimate_memory(MODEL, TRAINING, cfg, 80 * 1024**3, stack="megatron", options=fp8.memory_options)


def test_a_stack_prices_cpu_devices_with_its_cpu_constants() -> None:
    tiny = ModelSpec.preset("tiny-llama")
    job = TrainingSpec(global_batch=8, seq_len=64, dtype="fp32", method="lora")
    cpu4 = homogeneous_cluster("cpu", 1, 4, 5e9, 5e9, name="cpu-4")
    cfg = ParallelConfig(tp=1, pp=1, dp=4, mbs=2, zero_stage=1, global_batch=8)
    for name in ("pipette", "fsdp"):
        stack = get_stack(name)
        assert stack.cpu_constants is not None and stack.cpu_constants != stack.constants
        assert estimate_perf(tiny, job, cfg, cpu4, stack=name).step_time \
            == estimate_perf(tiny, job, cfg, cpu4, constants=stack.cpu_constants).step_time


@pytest.mark.parametrize("name", list(STACKS))
def test_make_plan_with_each_stack(name: str) -> None:
    stack = get_stack(name)
    plan = make_plan(MODEL, TRAINING, A100S, optimize_top=3, stack=name)
    assert plan.stack == stack and plan.fits_prior is stack.fits_prior("gpu")
    assert plan.ranked and all(stack.refusals(p.config) == [] for p in plan.ranked)
    assert plan.to_dict(top=1)["stack"]["name"] == name
    assert len(plan.ranked) + sum(plan.dropped.values()) == plan.enumerated
    best = plan.best.config
    assert plan.best.perf.step_time == pytest.approx(PerfModel(
        MODEL, TRAINING, best, A100S, constants=stack.constants).estimate(best.placement).step_time)


def test_the_plan_counts_what_the_stack_cannot_run() -> None:
    plan = make_plan(MODEL, TRAINING, A100S, optimize_top=1, stack="pipette")
    assert plan.dropped["stack_schedule"] > 0  # interleaved: the runner refuses it
    assert all(p.config.schedule == "1f1b" for p in plan.ranked)
    fsdp = make_plan(MODEL, TRAINING, A100S, optimize_top=1, stack="fsdp")
    assert fsdp.dropped["stack_zero"] > 0 and all(p.config.zero_stage != 1 for p in fsdp.ranked)


def test_a_recipe_the_stack_cannot_run_says_so() -> None:
    training = replace(TRAINING, zero_stages=(1,))
    with pytest.raises(InfeasibleError) as e:
        make_plan(MODEL, training, A100S, stack="fsdp")
    assert e.value.field == "stack" and "on stack fsdp" in e.value.message
    assert "ZeRO [0, 2, 3]" in str(e.value.fix)


# ---- the job key and trial records ------------------------------------------------------

def test_the_job_key_differs_by_stack_and_keeps_the_runners_old_key() -> None:
    keys = {name: job_key(MODEL, TRAINING, name) for name in STACKS}
    assert len(set(keys.values())) == len(STACKS)
    assert job_key(MODEL, TRAINING, "fsdp+compile") != keys["fsdp"]
    assert keys["pipette"] == job_key(MODEL, TRAINING)  # records stored before stacks still match
    # the key before stacks: model and recipe only
    import hashlib
    old = hashlib.sha256(json.dumps({"model": MODEL.to_dict(), "training": TRAINING.to_dict()},
                                    sort_keys=True).encode()).hexdigest()[:16]
    assert keys["pipette"] == old


def _record(plan: Plan, stack: str) -> TrialRecord:
    planned = plan.ranked[0]
    m = Measurement("ok", step_times=(3.0, 3.0, 3.0), tokens_per_step=TRAINING.tokens_per_step)
    return TrialRecord(1, planned.config, m, planned.perf, planned.memory, 3.0, job_key="another job", stack=stack)


def test_a_trial_record_carries_its_stack() -> None:
    data = _record(make_plan(MODEL, TRAINING, A100S, optimize_top=1), "fsdp").to_dict()
    assert data["stack"] == "fsdp" and TrialRecord.from_dict(data).stack == "fsdp"
    data.pop("stack")
    assert TrialRecord.from_dict(data).stack == "pipette"  # written before stacks existed


def test_the_learned_model_never_learns_from_another_stacks_trials() -> None:
    plan = make_plan(MODEL, TRAINING, A100S, optimize_top=1, stack="megatron")
    records = [_record(plan, "pipette"), _record(plan, "fsdp"), _record(plan, "megatron")]
    tuner = Tuner(plan, prior=records)
    assert tuner.stack == "megatron" and tuner.job_key == job_key(MODEL, TRAINING, "megatron")
    assert len(tuner.sampler.prior) == 1  # the megatron trial only


# ---- the emitted files ------------------------------------------------------------------

def test_launch_files_per_stack_name_it(tmp_path: Path) -> None:
    cfg = make_plan(MODEL, TRAINING, A100S, optimize_top=1).best.config
    ds = write_launch_files(tmp_path / "ds", MODEL, TRAINING, cfg, A100S)
    assert set(ds) == {"ds_config.json", "hostfile", "rank_map.json", "candidate.json", "launch.sh"}
    assert json.loads(ds["candidate.json"].read_text())["stack"]["name"] == "pipette"
    assert "stack pipette." in ds["launch.sh"].read_text().splitlines()[1]
    mg = write_launch_files(tmp_path / "mg", MODEL, TRAINING, cfg, A100S, stack="megatron+fp8")
    # no DeepSpeed config for Megatron: its own arguments (on an A100 without FP8: priced as bf16, no FP8 flags)
    assert set(mg) == {"hostfile", "rank_map.json", "candidate.json", "megatron_args.txt"}
    assert "--fp8-format" not in mg["megatron_args.txt"].read_text()
    nt = write_launch_files(tmp_path / "nt", MODEL, TRAINING, cfg, A100S, stack="nanotron")
    assert set(nt) == {"hostfile", "rank_map.json", "candidate.json", "nanotron.yaml"}
    stack = json.loads(mg["candidate.json"].read_text())["stack"]
    assert stack["name"] == "megatron+fp8" and stack["options_note"] is None  # fp8 is priced
    assert "compile: not modelled" in (get_stack("hf-deepspeed+compile").options_note or "")
    assert get_stack("fsdp+compile+fp8").options_note is None  # fsdp prices compile (CompileTerms)


def test_the_native_runner_gets_a_torchrun_launch(tmp_path: Path) -> None:
    """An fsdp pick runs Pipette's PyTorch-native runner: ``launch.sh`` starts it with torchrun (no
    DeepSpeed config); with an option the runner does not run (compile) no launcher is written;
    across nodes each node is told its NODE_RANK in the order the rank map numbers them."""
    from pipette.emit import stack_launch_command

    cfg = replace(make_plan(MODEL, TRAINING, A100S, optimize_top=1, stack="fsdp").best.config, placement=None)
    files = write_launch_files(tmp_path / "f", MODEL, TRAINING, cfg, A100S, stack="fsdp")
    assert set(files) == {"hostfile", "rank_map.json", "candidate.json", "launch.sh"}
    launch = files["launch.sh"].read_text()
    assert "-m torch.distributed.run" in launch and "-m workers.rank.fsdp" in launch and "deepspeed" not in launch
    nodes = sorted({A100S.devices[d].node for d in cfg.devices()})
    assert len(nodes) == 2  # the plan's pick spans both nodes: the one-node command is the CPU launch test's
    assert stack_launch_command(cfg, A100S, "fsdp") == "on node0: NODE_RANK=0 ./launch.sh; " \
        "on node1: NODE_RANK=1 ./launch.sh"
    assert "--nnodes 2" in launch and 'case "$NODE_RANK" in' in launch and "--master_addr node0" in launch
    assert "DS_ACCELERATOR" not in launch and "TORCH_EXTENSIONS_DIR" not in launch
    compiled = write_launch_files(tmp_path / "c", MODEL, TRAINING, cfg, A100S, stack="fsdp+compile")
    assert set(compiled) == {"hostfile", "rank_map.json", "candidate.json"}
    assert stack_launch_command(cfg, A100S, "fsdp+compile") is None
    assert stack_launch_command(cfg, A100S, "megatron") is None
    # across nodes the DeepSpeed runner's launch.sh runs per node too (its --no_ssh launch)
    assert stack_launch_command(cfg, A100S, "pipette") == stack_launch_command(cfg, A100S, "fsdp")


def test_the_native_launch_names_each_node_in_the_rank_maps_order() -> None:
    """Two nodes, the ranks placed on node 1 first: torchrun's node rank 0 is node 0 all the same
    (``workers.rank.train.pipette_rank`` reads the nodes in ascending order), showing its devices
    in rank order."""
    from pipette.emit import native_lines, runner_nodes

    cluster = homogeneous_cluster("A100-80GB", 2, 2, 300e9, 25e9)
    cfg = ParallelConfig(tp=2, pp=1, dp=2, mbs=1, global_batch=8, placement=(3, 2, 1, 0), stack="fsdp")
    assert runner_nodes(cfg, cluster) == [(0, [1, 0]), (1, [1, 0])]
    lines = "\n".join(native_lines(cfg, cluster))
    assert "0) NPROC=2; CUDA_VISIBLE_DEVICES=1,0; ;;" in lines and "1) NPROC=2; CUDA_VISIBLE_DEVICES=1,0; ;;" in lines
    assert '--nnodes 2 --nproc_per_node "$NPROC" --node_rank "$NODE_RANK"' in lines


# ---- the command line -------------------------------------------------------------------

def pipette(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


PLAN = ("plan", "--model", "llama2-7b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"), "--global-batch", "64",
        "--seq-len", "4096", "--method", "lora", "--top", "3")


def test_plan_stack_flag_is_shown_and_written(tmp_path: Path) -> None:
    r = pipette(*PLAN, "--stack", "megatron", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "stack megatron: Megatron-LM, NeMo" in r.stdout
    assert json.loads((tmp_path / "o" / "candidate.json").read_text())["stack"]["name"] == "megatron"
    assert "./launch.sh" not in r.stdout and "megatron_args.txt" in r.stdout
    assert "--tensor-model-parallel-size" in (tmp_path / "o" / "megatron_args.txt").read_text()
    r = pipette(*PLAN, "--stack", "fsdp", "--json", "--no-files")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    # Pipette's native runner runs an fsdp pick (torchrun); with compile, which it does not run, nothing
    assert data["stack"]["name"] == "fsdp" and data["launch_command"].startswith("on node0: NODE_RANK=0 ./launch.sh")
    r = pipette(*PLAN, "--stack", "fsdp+compile", "--json", "--no-files")
    assert r.returncode == 0 and json.loads(r.stdout)["launch_command"] is None, r.stderr


@pytest.mark.parametrize(("stack", "words"), [
    ("bogus", ["--stack: unknown stack 'bogus'", "use one of pipette, hf-deepspeed, megatron, nanotron, fsdp"]),
    ("megatron+compile", ["--stack: megatron has no option 'compile'", "megatron+fp8"]),
])
def test_plan_refuses_a_bad_stack_in_one_line(stack: str, words: list[str]) -> None:
    r = pipette(*PLAN, "--stack", stack, "--no-files")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert all(w in line for w in words), line


@pytest.mark.parametrize("stack", ["megatron", "nanotron", "hf-deepspeed"])
def test_tune_without_a_script_refuses_a_stack_its_runner_does_not_run(stack: str, tmp_path: Path) -> None:
    r = pipette("tune", "--stack", stack, "--home", str(tmp_path), "--max-trials", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pipette: error: --stack: {stack} cannot be tuned by Pipette's runner, "
                           "which runs pipette, fsdp only"), line
    assert "--script" in line and not (tmp_path / "profiles").exists()  # refused before measuring


def test_a_job_file_carries_its_stack_to_the_api(tmp_path: Path) -> None:
    from cli.client_jobfile import load_job_file

    job = tmp_path / "job.yaml"
    job.write_text("cluster: local\nmodel: tiny-llama\ntraining: {global_batch: 4, seq_len: 32}\nstack: pipette\n")
    assert load_job_file(str(job))["stack"] == "pipette"
    assert load_job_file(str(job), ["stack=hf-deepspeed"])["stack"] == "hf-deepspeed"
    # several side by side: a list, or the API's comma-separated words
    assert load_job_file(str(job), ["stack=[pipette, fsdp]"])["stack"] == "pipette,fsdp"
    assert load_job_file(str(job), ["stack=pipette,fsdp"])["stack"] == "pipette,fsdp"


@pytest.mark.parametrize(("stack", "device", "noted"), [
    ("pipette", "H100-80GB", False), ("pipette", "H200-141GB", False), ("pipette", "cpu", False),
    ("pipette", "A100-80GB", True), ("hf-deepspeed", "B200-180GB", True),
    ("megatron", "A100-80GB", False), ("megatron", "B200-180GB", False), ("megatron", "H100-80GB", False),
    ("megatron", "V100-32GB", True), ("megatron", "cpu", True),
    ("nanotron", "H100-80GB", False), ("nanotron", "B200-180GB", True),
    ("fsdp+compile", "GH200-96GB", False), ("fsdp", "A100-40GB", True), ("fsdp", "cpu", False),
])
def test_a_stack_says_where_its_constants_were_never_fitted(stack: str, device: str, noted: bool) -> None:
    """Constants fitted on one device family price another only with a note saying so (the plan's
    ``calibration_notes``, printed under the stack line), naming the runs they came from."""
    spec = DeviceSpec.preset(device)
    note = get_stack(stack).calibration_note(spec)
    assert (note is not None) == noted
    if note:
        assert note.startswith(f"{get_stack(stack).key}: step-time constants fitted on ") and "untested" in note
        assert ("CPU devices" if spec.kind == "cpu" else spec.name) in note


def test_the_plan_carries_the_calibration_notes_of_its_stacks() -> None:
    a100 = homogeneous_cluster("A100-80GB", 1, 8, 300e9, 25e9, name="a100s")
    plan = make_plan(MODEL, TRAINING, a100, stack=["pipette", "fsdp"])
    assert [n.split(":")[0] for n in plan.calibration_notes] == ["pipette", "fsdp"]
    assert plan.to_dict(top=1)["calibration_notes"] == plan.calibration_notes
    assert make_plan(MODEL, TRAINING, a100, stack="megatron").calibration_notes == []
