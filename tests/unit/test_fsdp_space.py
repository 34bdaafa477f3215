"""The fsdp stack's space (HSDP over nodes, FSDP sharding under a pipeline, offload as the last
resort, the runner's split rules), its FSDP2 memory terms, and one plan over several stacks
(``--stack pipette,fsdp``): each candidate names and is priced by its own stack, and the learned
model keeps the stacks apart."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from pipette.clusterfile import homogeneous_cluster, load_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.estimates import MemoryEstimate, PerfEstimate
from pipette.learned import LearnedModel, Observation
from pipette.measurement import Measurement
from pipette.memory import FSDP_OPTIONS, estimate_memory, stage_breakdowns
from pipette.model import ModelSpec
from pipette.perf import estimate_perf
from pipette.plan import Plan, make_plan
from pipette.registry import stacks_to_tune
from pipette.search import candidate_params, params_key
from pipette.stacks import FSDP, PIPETTE, get_stacks
from pipette.training import LoraSpec, TrainingSpec
from pipette.tuner import job_key
from workers.fsdp_spec import check_fsdp

ROOT = Path(__file__).resolve().parents[2]
CPU4 = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
A100_2X8 = homogeneous_cluster("A100-80GB", 2, 8, 300e9, 25e9)
TINY = ModelSpec.preset("tiny-llama")
TUNE_DEFAULT = TrainingSpec(global_batch=16, seq_len=128, dtype="fp32", method="lora", lora=LoraSpec(rank=8, alpha=16))
LLAMA7B = ModelSpec.preset("llama2-7b")
BF16 = TrainingSpec(global_batch=64, seq_len=4096)
GiB = 1024**3

#: the jobs the space is enumerated on: (model, recipe, cluster)
JOBS = {
    "tiny-llama on 4 CPU devices": (TINY, TUNE_DEFAULT, CPU4),
    "tiny-llama-gqa on 4 CPU devices": (ModelSpec.preset("tiny-llama-gqa"), TUNE_DEFAULT, CPU4),
    "llama2-7b on 2 x 8 A100": (LLAMA7B, BF16, A100_2X8),
    "llama2-13b on 8 A100-40GB": (ModelSpec.preset("llama2-13b"), BF16, homogeneous_cluster("A100-40GB", 1, 8, 300e9,
                                                                                           25e9)),
    # 10 layers: interleaving over pp 4 x 2 virtual stages splits them 2, 2, 1, 1, ... (uneven_virtual_stages)
    "a 10-layer llama on 8 A100": (replace(TINY, name="tiny-llama-10l", layers=10), TUNE_DEFAULT,
                                   homogeneous_cluster("A100-80GB", 1, 8, 300e9, 25e9)),
}


def _labels(plan: Plan) -> str:
    return hashlib.sha256("\n".join(sorted(p.config.label for p in plan.ranked)).encode()).hexdigest()[:16]


@pytest.mark.parametrize("job", list(JOBS))
def test_every_fsdp_candidate_passes_the_runners_own_check(job: str) -> None:
    model, training, cluster = JOBS[job]
    plan = make_plan(model, training, cluster, stack="fsdp")
    configs = [p.config for p in plan.ranked] + [d.config for d in plan.out_of_memory]
    assert configs
    for config in configs:
        check_fsdp(model, training, config, cluster.device_spec.kind, world=cluster.world)  # raises if not
    assert all(c.zero_stage != 1 for c in configs)
    if model.layers == 10:  # the layers pp x virtual stages do not divide are planned, priced finite
        uneven = [p for p in plan.ranked if p.config.schedule == "interleaved"
                  and model.layers % (p.config.pp * p.config.virtual_stages)]
        assert uneven and all(0 < p.perf.step_time < float("inf") for p in uneven)
        assert "interleaved_layers" not in plan.dropped


def test_the_deepspeed_stacks_space_is_unchanged() -> None:
    # counts and label hashes of make_plan(..., stack="pipette") on main before the fsdp space (a784a50);
    # the 7B's ranked count moved 511 -> 519 when the pipette stack began comparing device-used bytes with its
    # refitted prior (45f4351, issue 46): a change of the memory check, not of the space
    for (model, training, cluster), (enumerated, ranked, digest) in (
        ((TINY, TUNE_DEFAULT, CPU4), (816, 228, "4892b3544731489c")),
        ((LLAMA7B, BF16, A100_2X8), (3180, 519, "40a55e0f3c59ffdc")),
    ):
        plan = make_plan(model, training, cluster, stack="pipette")
        assert (plan.enumerated, len(plan.ranked), _labels(plan)) == (enumerated, ranked, digest)
        assert all(p.config.stack is None and p.config.dp_shard is None and not p.config.offload for p in plan.ranked)


def test_fsdp_shards_under_a_pipeline_and_hsdp_shards_within_a_node() -> None:
    plan = make_plan(LLAMA7B, BF16, A100_2X8, stack="fsdp")
    configs = [p.config for p in plan.ranked]
    assert any(c.pp > 1 and c.zero_stage == 3 for c in configs)  # DeepSpeed's pipeline engine refuses it
    hsdp = [c for c in configs if c.dp_shard is not None]
    assert hsdp and {c.zero_stage for c in hsdp} <= {2, 3}
    shards = [(c.dp_shard or 0, c) for c in hsdp]
    assert all(d * c.tp == 8 and c.dp // d >= 2 for d, c in shards)  # a node's 8 shard, the nodes replicate
    # one node: nothing to replicate across
    one_node = make_plan(TINY, TUNE_DEFAULT, CPU4, stack="fsdp")
    assert all(p.config.dp_shard is None for p in one_node.ranked)
    assert any(p.config.pp > 1 and p.config.zero_stage in (2, 3) for p in one_node.ranked)


def test_offload_is_offered_only_where_the_candidate_without_it_would_not_fit() -> None:
    model, training, cluster = JOBS["llama2-13b on 8 A100-40GB"]
    plan = make_plan(model, training, cluster, stack="fsdp")
    offloaded = [p for p in plan.ranked if p.config.offload]
    assert offloaded
    kept = {p.config.label for p in plan.ranked}
    for p in offloaded:
        assert p.config.zero_stage >= 2 and p.memory.host_bytes > 0
        assert replace(p.config, offload=False).label not in kept
    assert not any(p.config.offload for p in make_plan(TINY, TUNE_DEFAULT, CPU4, stack="fsdp").ranked)  # CPU: no gain


def _mem(config: ParallelConfig, training: TrainingSpec = BF16, kind: str = "gpu") -> MemoryEstimate:
    return estimate_memory(LLAMA7B, training, config, 80 * GiB, device_kind=kind, options=FSDP_OPTIONS)


def test_fsdp2_memory_terms() -> None:
    z3 = ParallelConfig(tp=1, pp=1, dp=16, mbs=1, global_batch=64, zero_stage=3)
    psi = LLAMA7B.total_params()
    m3 = _mem(z3)
    # sharded fp32 parameters (the optimizer's master), fp32 gradients, Adam's two moments over dp
    assert m3.breakdown["gradients"] == pytest.approx(4 * psi / 16, rel=1e-6)
    assert m3.breakdown["optimizer"] == pytest.approx(8 * psi / 16, rel=1e-6)
    # no reshard after forward keeps every unit's unsharded bf16 parameters, the root's too: a whole bf16
    # model at the loss, where FULL_SHARD has resharded them all (pipette.memory_fsdp2)
    m2 = _mem(replace(z3, zero_stage=2))
    at_loss = [stage_breakdowns(LLAMA7B, BF16, c, options=FSDP_OPTIONS, phase="loss")[0]["weights"]
               for c in (replace(z3, zero_stage=2), z3)]
    assert at_loss[0] - at_loss[1] == pytest.approx(2 * psi, rel=1e-3)
    assert m2.peak_bytes > m3.peak_bytes
    # HSDP shards over dp_shard only
    hsdp = _mem(replace(z3, dp_shard=8))
    assert hsdp.breakdown["optimizer"] == pytest.approx(2 * m3.breakdown["optimizer"], rel=1e-6)
    # NO_SHARD: whole fp32 states on every replica
    assert _mem(replace(z3, zero_stage=0)).breakdown["optimizer"] == pytest.approx(8 * psi, rel=1e-6)
    # offload: the sharded states go to the host; the gathered layers stay
    off = _mem(replace(z3, offload=True))
    moved = m3.breakdown["gradients"] + m3.breakdown["optimizer"]
    assert off.breakdown["gradients"] == off.breakdown["optimizer"] == 0
    assert off.host_bytes == pytest.approx(moved + 4 * psi / 16, rel=1e-6)
    assert off.peak_bytes == pytest.approx(m3.peak_bytes - off.host_bytes, rel=1e-6)
    # on CPU devices the host is the device: offload moves nothing
    cpu = _mem(z3, kind="cpu")
    cpu_off = _mem(replace(z3, offload=True), kind="cpu")
    assert cpu_off.peak_bytes == cpu.peak_bytes and cpu_off.host_bytes == 0


def test_one_plan_ranks_both_families_each_priced_by_its_own_stack() -> None:
    plan = make_plan(TINY, TUNE_DEFAULT, CPU4, stack="pipette,fsdp")
    assert [s.key for s in plan.all_stacks] == ["pipette", "fsdp"] and plan.stack_key == "pipette,fsdp"
    by_stack = {s: [p for p in plan.ranked if p.config.stack == s] for s in ("pipette", "fsdp")}
    assert by_stack["pipette"] and by_stack["fsdp"] and sum(map(len, by_stack.values())) == len(plan.ranked)
    single = {s: {p.config.label for p in make_plan(TINY, TUNE_DEFAULT, CPU4, stack=s).ranked}
              for s in ("pipette", "fsdp")}
    for name, planned in by_stack.items():
        stack = plan.stack_of(planned[0].config)
        assert stack.key == name
        assert {replace(p.config, stack=None).label for p in planned} == single[name]
        for p in planned[:5]:
            assert p.memory == estimate_memory(TINY, TUNE_DEFAULT, p.config, CPU4.min_usable_memory,
                                                     device_kind="cpu", stack=stack)
            assert p.perf.step_time == pytest.approx(
                estimate_perf(TINY, TUNE_DEFAULT, p.config, CPU4, stack=stack).step_time, rel=1e-9)
    # labels and the study's parameters tell the families apart
    assert len({p.config.label for p in plan.ranked}) == len(plan.ranked)
    assert len({params_key(candidate_params(p.config)) for p in plan.ranked}) == len(plan.ranked)
    assert plan.to_dict(top=1)["stacks"][1]["name"] == "fsdp"
    assert job_key(TINY, TUNE_DEFAULT, plan.all_stacks) not in {job_key(TINY, TUNE_DEFAULT, s) for s in single}


def test_several_stacks_are_named_once_each_and_tuned_by_the_runners_only() -> None:
    assert get_stacks("pipette, fsdp") == (PIPETTE, FSDP)
    assert stacks_to_tune("pipette,fsdp", script=False) == (PIPETTE, FSDP)
    for bad, words in (("pipette,pipette", "twice"), ("pipette,", "commas"), ("pipette,deepspeed", "unknown")):
        with pytest.raises(SpecError) as e:
            get_stacks(bad, field="--stack")
        assert e.value.field == "--stack" and words in str(e.value)
    with pytest.raises(SpecError, match="cannot be tuned by Pipette's runner"):
        stacks_to_tune("pipette,megatron", script=False)
    with pytest.raises(SpecError, match="for one script"):
        stacks_to_tune("pipette,fsdp", script=True)


def _observation(config: ParallelConfig, perf: PerfEstimate, memory: MemoryEstimate, seconds: float) -> Observation:
    m = Measurement("ok", step_times=(seconds,) * 5, tokens_per_step=2048)
    return Observation(config, perf, memory, m, job_key="job")


def test_the_learned_model_learns_each_stacks_offset_apart() -> None:
    plan = make_plan(TINY, TUNE_DEFAULT, CPU4, stack="pipette,fsdp")
    ds = [p for p in plan.ranked if p.config.stack == "pipette"][:4]
    fs = [p for p in plan.ranked if p.config.stack == "fsdp"]
    # the DeepSpeed trials ran 3x slower than predicted
    learned = LearnedModel([_observation(p.config, p.perf, p.memory, 3.0 * p.perf.step_time) for p in ds],
                           job_key="job")
    other_ds = [p for p in plan.ranked if p.config.stack == "pipette"][4]
    ds_factor = learned.predict(other_ds.config, other_ds.perf).step_time / other_ds.perf.step_time
    fs_factor = learned.predict(fs[0].config, fs[0].perf).step_time / fs[0].perf.step_time
    assert ds_factor > 2.5  # its own stack: learned
    assert 1.0 < fs_factor < ds_factor  # the other stack: through the correlation only
    # with the stacks unnamed (one stack) every candidate moves alike: the stack is what kept them apart
    plain = LearnedModel([_observation(replace(p.config, stack=None), p.perf, p.memory, 3.0 * p.perf.step_time)
                          for p in ds], job_key="job")
    same = plain.predict(replace(fs[0].config, stack=None), fs[0].perf).step_time / fs[0].perf.step_time
    assert same > fs_factor


def test_the_trial_runs_on_the_candidates_own_stack() -> None:
    from workers.host.runner import RayTrialRunner

    runner = RayTrialRunner(TINY, TUNE_DEFAULT, CPU4, stack="pipette")
    plan = make_plan(TINY, TUNE_DEFAULT, CPU4, stack="pipette,fsdp")
    fsdp = next(p.config for p in plan.ranked if p.config.stack == "fsdp" and p.config.zero_stage == 3)
    ds = next(p.config for p in plan.ranked if p.config.stack == "pipette" and p.config.zero_stage == 1)
    assert runner.trial(fsdp).stack == "fsdp" and runner.trial(ds).stack == "pipette"
    assert runner.refusals(fsdp) == [] and runner.refusals(ds) == []
    # ZeRO-1 is DeepSpeed's: the same candidate named for the fsdp stack is refused by its runner
    assert runner.refusals(replace(ds, stack="fsdp"))


def _a100_40(host_memory: str | None) -> dict[str, object]:
    data: dict[str, object] = {"name": "a100-40-x8", "device": {"preset": "A100-40GB"}, "nodes": 1,
                               "devices_per_node": 8, "intra_node": {"bandwidth": "300 GB/s", "latency": "5 us"}}
    return data if host_memory is None else {**data, "host_memory": host_memory}


def test_offload_keeps_the_ranks_host_bytes_within_the_nodes_host_memory() -> None:
    from pipette.clusterfile import cluster_from_dict

    model, training = ModelSpec.preset("llama2-13b"), BF16
    unknown = make_plan(model, training, cluster_from_dict(_a100_40(None)), stack="fsdp")
    offloaded = [p for p in unknown.ranked if p.config.offload]
    assert offloaded and all("not checked" in " ".join(p.memory.notes) for p in offloaded)
    need = max(p.memory.host_bytes for p in offloaded) * 8  # a node holds its 8 ranks
    roomy = cluster_from_dict(_a100_40(f"{need / GiB + 1:.0f} GiB"))
    assert roomy.nodes[0].host_memory is not None and roomy.to_dict()["nodes"][0]["host_memory"] > need
    kept = make_plan(model, training, roomy, stack="fsdp")
    assert {p.config.label for p in kept.ranked if p.config.offload} == {p.config.label for p in offloaded}
    small = make_plan(model, training, cluster_from_dict(_a100_40("64 GiB")), stack="fsdp")
    smallest = min(p.memory.host_bytes for p in offloaded) * 8
    assert 64 * GiB < smallest and not any(p.config.offload for p in small.ranked)
    assert any("more than the 64 GiB a node has" in " ".join(d.memory.notes) for d in small.out_of_memory)
