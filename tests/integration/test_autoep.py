"""The hf-deepspeed stack's expert parallelism is DeepSpeed's AutoEP (DeepSpeed 0.19): the expert groups
Pipette prices are AutoEP's own, group for group, and the ds_config.json Pipette writes for an ep > 1
candidate runs as printed: real DeepSpeed over 2 gloo ranks replaces a Hugging Face Mixtral's MoE
blocks, each rank holds the experts the memory estimate counts, and the steps train."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from deepspeed.module_inject.auto_ep_folding import build_folding_spec, expected_folding_group_tables

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.emit import write_launch_files
from pipette.memory_moe import mlp_params
from pipette.model import ModelSpec
from pipette.perf_moe import expert_groups
from pipette.plan import make_plan
from pipette.training import TrainingSpec

TINY = ModelSpec.preset("tiny-moe")


@pytest.mark.parametrize(("tp", "pp", "dp", "ep"), [(1, 1, 8, 2), (1, 1, 8, 8), (2, 1, 4, 2), (1, 2, 4, 4),
                                                    (4, 1, 2, 2)])
def test_the_expert_groups_priced_are_autoeps(tp: int, pp: int, dp: int, ep: int) -> None:
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, etp=1, mbs=1, global_batch=dp)
    spec = build_folding_spec(world_size=config.world, pp_size=pp, tp_size=tp, ep_size=ep, etp_size=1)
    tables = expected_folding_group_tables(spec)
    experts = TINY.moe.experts  # type: ignore[union-attr]
    assert sorted(map(tuple, expert_groups(config, experts, "ep").tolist())) == sorted(tables.ep_groups)
    assert sorted(map(tuple, expert_groups(config, experts, "edp").tolist())) == sorted(tables.edp_groups)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, ds_config: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    from workers.rank.autoep import accept_class_name_keys

    accept_class_name_keys()
    import deepspeed
    from transformers import MixtralConfig, MixtralForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    moe = TINY.moe
    assert moe is not None
    config = MixtralConfig(vocab_size=TINY.vocab, hidden_size=TINY.hidden, intermediate_size=moe.expert_ffn,
                           num_hidden_layers=TINY.layers, num_attention_heads=TINY.heads,
                           num_key_value_heads=TINY.kv_heads, num_local_experts=moe.experts,
                           num_experts_per_tok=moe.top_k, max_position_embeddings=TINY.max_seq, use_cache=False)
    model = MixtralForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    layer = engine.module.model.layers[0].mlp
    experts = sum(p.numel() for name, p in layer.named_parameters() if "expert" in name)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, TINY.vocab, (ds_config["train_micro_batch_size_per_gpu"], 64), generator=g)
    losses = []
    for _ in range(4):  # the same batch: the loss falls where the replaced layers train
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    Path(out, f"{rank}.json").write_text(json.dumps({"layer": type(layer).__name__, "experts": experts,
                                                     "losses": losses}))


@pytest.mark.slow
def test_the_written_ds_config_runs_autoep_as_printed(tmp_path: Path) -> None:
    training = TrainingSpec(global_batch=4, seq_len=64, dtype="fp32", zero_stages=(1,), recompute=("none",),
                            micro_batches=(2,))
    cluster = homogeneous_cluster("H100-80GB", 1, 2, 450e9, 50e9, name="h2")
    plan = make_plan(TINY, training, cluster, stack="hf-deepspeed")
    chosen = next(p.config for p in plan.ranked if p.config.ep == 2)
    assert (chosen.tp, chosen.pp, chosen.dp, chosen.etp) == (1, 1, 2, None)
    files = write_launch_files(tmp_path / "out", TINY, training, chosen, cluster, stack="hf-deepspeed")
    ds = json.loads(files["ds_config.json"].read_text())
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    mp.spawn(_rank, args=(2, _free_port(), ds, str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    local = mlp_params(TINY, chosen)[2]  # the memory estimate's local experts of one MoE layer
    for r in ranks:
        assert r["layer"] == "AutoEPMoELayer"
        assert r["experts"] == local  # E / ep experts of 3 h f_e each: half of the 8
        assert np.isfinite(r["losses"]).all() and r["losses"][-1] < r["losses"][0]
