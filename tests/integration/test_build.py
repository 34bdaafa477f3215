"""Each rank builds only what it holds (``workers.rank.build``): its tensor-parallel shards equal the
same slices of one unsharded build, it holds the bytes the memory estimator counts for it, a
local checkpoint is read slice by slice, and a checkpoint that is not the model's is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipette.config import ParallelConfig
from pipette.datafiles import check_checkpoint, llama_tensor_shapes
from pipette.errors import SpecError
from pipette.memory import stage_breakdowns
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.host.executor import run_trial
from workers.rank.build import build_rank_model, held_modules, materialize, prepare
from workers.rank.checkpoint import Checkpoint
from workers.rank.hf_model import build_llama
from workers.spec import TrialSpec

CPU = torch.device("cpu")


def spec(model: str = "tiny-llama", tp: int = 1, pp: int = 1, method: str = "full", dtype: str = "fp32",
         **options: Any) -> TrialSpec:
    lora = LoraSpec(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    training = TrainingSpec(global_batch=4, seq_len=32, dtype=dtype, method=method,  # type: ignore[arg-type]
                            lora=lora if method == "lora" else None)
    return TrialSpec(ModelSpec.preset(model), training, ParallelConfig(tp=tp, pp=pp, dp=1, mbs=1, global_batch=4),
                     **options)


def by_name(module: nn.Module) -> dict[str, nn.Parameter]:
    return {p.pipette_name: p for p in module.parameters()}  # type: ignore[attr-defined]


def full_slice(full: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    rows, cols = getattr(p, "pipette_rows", None), getattr(p, "pipette_cols", None)
    out = full[rows[0]:rows[1]] if rows else full
    return out[:, cols[0]:cols[1]] if cols else out


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama-tied"])
def test_a_tp2_shard_pair_equals_one_unsharded_build(method: str, model: str) -> None:
    one = by_name(build_rank_model(spec(model, method=method), 0, CPU, torch.float32).module)
    for rank in (0, 1):
        shards = by_name(build_rank_model(spec(model, tp=2, method=method), rank, CPU, torch.float32).module)
        assert set(shards) == set(one)
        for name, p in shards.items():
            want = full_slice(one[name].detach(), p)
            assert p.shape == want.shape, name
            assert torch.allclose(p.detach(), want, atol=1e-6, rtol=0), name
        sharded = [n for n, p in shards.items() if hasattr(p, "pipette_rows") or hasattr(p, "pipette_cols")]
        assert any("embed_tokens" in n for n in sharded) and any("down_proj" in n for n in sharded)
    # seeded: another seed, other values
    other = by_name(build_rank_model(spec(model, method=method, seed=1), 0, CPU, torch.float32).module)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(other[q], one[q])


def held_bytes_of(trial: TrialSpec, rank: int) -> int:
    """Bytes of the parameters rank ``rank`` holds, counted on the meta build (no values)."""
    prep = prepare(trial, rank, torch.float32)
    seen = {id(p): p for m in held_modules(prep, trial, rank) for p in m.parameters()}
    return sum(p.numel() * 4 for p in seen.values())


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama-tied"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_rank_holds_the_weights_the_estimator_counts(model: str, tp: int, pp: int, method: str) -> None:
    trial = spec(model, tp=tp, pp=pp, method=method)
    stages = stage_breakdowns(trial.model, trial.training, trial.config, device_kind="cpu")
    for rank in range(tp * pp):
        stage = trial.config.layout.index(rank, "pp")
        assert held_bytes_of(trial, rank) == stages[stage]["weights"], (rank, stage)


def test_a_stage_builds_only_its_layers() -> None:
    trial = spec("tiny-llama-tied", pp=2)
    prep = prepare(trial, 0, torch.float32)
    mine = held_modules(prep, trial, 0)
    materialize(mine, CPU, torch.float32, 0, prep.std)
    real = {p.pipette_name for m in mine for p in m.parameters() if not p.is_meta}  # type: ignore[attr-defined]
    assert "model.embed_tokens.weight" in real and "model.layers.1.mlp.up_proj.weight" in real
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm")) for n in real)
    others = {p.pipette_name for p in prep.hf.parameters() if p.is_meta}
    assert "model.layers.3.self_attn.q_proj.weight" in others  # never given values on stage 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(123)
    hf = build_llama(ModelSpec.preset("tiny-llama"))  # HF's own random initialisation, not Pipette's
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, {n: p.detach().clone() for n, p in hf.named_parameters()}


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_every_rank_reads_its_slices_of_a_local_checkpoint(checkpoint: tuple[Path, dict[str, torch.Tensor]],
                                                           tp: int, pp: int) -> None:
    folder, saved = checkpoint
    trial = spec(tp=tp, pp=pp, checkpoint=str(folder))
    source = Checkpoint(folder)
    for rank in range(tp * pp):
        prep = prepare(trial, rank, torch.float32)
        mine = held_modules(prep, trial, rank)
        materialize(mine, CPU, torch.float32, 0, prep.std, source)
        params = {p.pipette_name: p for m in mine for p in m.parameters()}  # type: ignore[attr-defined]
        assert params
        for name, p in params.items():
            assert torch.equal(p.detach(), full_slice(saved[name], p)), (rank, name)


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    build_llama(ModelSpec.preset("tiny-llama-gqa")).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(SpecError) as e:
        check_checkpoint(ModelSpec.preset("tiny-llama"), tmp_path)
    assert "model.layers.0.self_attn.k_proj.weight" in e.value.message and "[64, 128]" in e.value.message
    assert "[128, 128]" in e.value.message
    with pytest.raises(SpecError, match="no checkpoint folder"):
        check_checkpoint(ModelSpec.preset("tiny-llama"), tmp_path / "nowhere")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(SpecError, match="holds neither"):
        Checkpoint(tmp_path)


def test_a_trial_with_a_checkpoint_that_is_not_the_models_starts_no_rank(tmp_path: Path) -> None:
    build_llama(ModelSpec.preset("tiny-llama-gqa")).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(SpecError, match="k_proj"):
        run_trial(spec(checkpoint=str(tmp_path)), timeout_s=60)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_running_out_of_host_memory_while_building_ends_oom() -> None:
    """llama3.2-1b in fp32 (5 GB) on a CPU device capped at 1 GiB: the build fails allocating,
    and the trial ends ``oom`` on the host, in the build, not as a hang or a crash."""
    trial = spec("llama3.2-1b", memory_cap_bytes=2**30)
    m = run_trial(trial, timeout_s=240)
    assert m.status == "oom", (m.status, m.error)
    assert m.extra["oom_where"] == "host" and m.extra["oom_phase"] == "build", m.extra
    assert "ran out of host memory during build" in m.error


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-gqa", "llama3.2-1b"])
def test_the_torch_free_tensor_list_is_hugging_faces(name: str) -> None:
    """``pipette.datafiles`` names the model's tensors without torch: the same names, order and
    shapes as the Llama model Hugging Face builds (on the meta device)."""
    model = ModelSpec.preset(name)
    built = {n: tuple(p.shape) for n, p in build_llama(model, device="meta").named_parameters()}
    assert list(llama_tensor_shapes(model).items()) == list(built.items())


def test_the_checkpoint_index_of_a_sharded_save_is_read(tmp_path: Path) -> None:
    hf = build_llama(ModelSpec.preset("tiny-llama"))
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    check_checkpoint(ModelSpec.preset("tiny-llama"), tmp_path)
    ckpt = Checkpoint(tmp_path)
    name = "model.layers.3.mlp.down_proj.weight"
    assert torch.equal(ckpt.read(name, cols=(172, 344)), dict(hf.named_parameters())[name].detach()[:, 172:344])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trials_from_a_checkpoint_start_from_its_weights(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """One device and tp2 x pp2 start from the same checkpoint: the same first loss, and not
    the loss of Pipette's own random initialisation."""
    folder, _ = checkpoint
    one = run_trial(spec(checkpoint=str(folder), min_steps=1, max_steps=1), timeout_s=240)
    split = run_trial(spec(tp=2, pp=2, checkpoint=str(folder), min_steps=1, max_steps=1), timeout_s=240)
    fresh = run_trial(spec(min_steps=1, max_steps=1), timeout_s=240)
    assert one.status == split.status == fresh.status == "ok", (one.error, split.error, fresh.error)
    assert split.losses[0] == pytest.approx(one.losses[0], rel=1e-5)
    assert abs(fresh.losses[0] - one.losses[0]) > 1e-3


def test_tune_refuses_a_missing_checkpoint_before_measuring_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cli", "tune", "--checkpoint", str(tmp_path / "nowhere"),
                           "--home", str(tmp_path / "home")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"pipette: error: --checkpoint: no checkpoint folder '{tmp_path / 'nowhere'}' (fix: give the local folder "
        "save_pretrained wrote (it holds config.json and *.safetensors))"]
    assert not (tmp_path / "home" / "profiles").exists()
