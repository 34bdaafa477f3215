"""The planner's context parallelism (issue 48): the cp degree in the space, a cp rank's memory
(pipette.memory_cp), the ring's exposed exchange (pipette.perf_cp) and each stack's rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.memory import stage_breakdowns
from pipette.memory_cp import exchange_bytes, fold, kv_block_bytes
from pipette.memory_options import DEFAULT_OPTIONS
from pipette.model import ModelSpec, positions
from pipette.perf import PerfModel
from pipette.perf_cp import CP_PART, ring_step_exposed
from pipette.plan import check_recipe
from pipette.space import CP_MIN_SEQ_PER_HIDDEN, cp_degrees, enumerate_space
from pipette.stacks import get_stack, rank_layout, stack_layout
from pipette.training import TrainingSpec

#: one Llama layer, 8 query and 2 key/value heads of 64: h 512, kv 128, f 1024
ONE = ModelSpec(name="one-layer", layers=1, hidden=512, heads=8, kv_heads=2, ffn_hidden=1024, vocab=1000,
                max_seq=1 << 20, arch="llama")


def test_one_layer_activations_and_kv_exchange_by_hand() -> None:
    """cp=4 at s=32768, b=1, bf16, no recomputation, flash attention: Korthikanti's Llama terms at
    s/cp = 8192 tokens, and four KV blocks (two of K/V, two of their gradient) in flight."""
    s, cp, d, h, kv, f = 32768, 4, 2, 512, 128, 1024
    training = TrainingSpec(global_batch=1, seq_len=s)
    config = ParallelConfig(tp=1, pp=1, dp=1, mbs=1, global_batch=1, cp=cp)
    options = replace(DEFAULT_OPTIONS, flash_attention=True)
    part = stage_breakdowns(ONE, training, config, options=options)[0]
    local = s // cp
    split = d * local * (2 * h + 4 * f)  # q, context, gate, up, SiLU out, product
    kv_saved = 2 * d * local * kv  # k and v
    seq = 4 * d * local * h  # both norms' input and output
    assert part["activations"] == int(split + kv_saved + seq + 2 * d * local * h)  # + the head's norm
    block = 2 * local * kv * d
    assert kv_block_bytes(ONE, training, config) == block
    assert exchange_bytes(ONE, training, config, "p2p") == 4 * block
    # PyTorch's ring backward, all-gather rotation: the gathered K and V (cp blocks) and the copy they came
    # from, the kernel's bf16 dK and dV (a block), dK and dV in fp32 held, sent and received (3 x 2 blocks),
    # and q's bf16 gradient and fp32 accumulator (3 q); q = 8 heads of 64, four times a k/v block's width
    q = local * h * d
    assert exchange_bytes(ONE, training, config, "allgather") == (cp + 1 + 1 + 6) * block + 3 * q
    # torchtitan's Llama repeats K and V to the 8 query heads first: blocks 4x wider (h / kv)
    wide = 2 * local * h * d
    assert kv_block_bytes(ONE, training, config, repeat_kv=True) == wide == 4 * block
    assert exchange_bytes(ONE, training, config, "allgather", repeat_kv=True) == (cp + 8) * wide + 3 * q
    without = stage_breakdowns(ONE, training, replace(config, cp=1, dp=4, global_batch=4),
                               options=options)
    assert part["buffers"] - exchange_bytes(ONE, training, config, "p2p") <= without[0]["buffers"]


def test_fold_is_a_data_parallel_rank_of_shorter_sequences() -> None:
    training = TrainingSpec(global_batch=8, seq_len=65536)
    config = ParallelConfig(tp=2, pp=1, dp=2, mbs=1, global_batch=8, zero_stage=3, cp=4, dp_shard=1)
    t, c = fold(training, config)
    assert (t.seq_len, t.global_batch, c.dp, c.cp, c.dp_shard, c.grad_accum) == (16384, 32, 8, 1, 4, 4)
    assert c.world == config.world
    # the folded mesh's dp groups are the candidate's dp x cp groups
    assert c.layout.groups("dp") == config.layout.groups("dp_cp")


@pytest.mark.parametrize(("transfer", "block", "exposed"), [(1.0, 3.0, 0.0), (1.0, 0.25, 0.75)])
def test_a_ring_step_hides_its_transfer_under_a_long_block_only(transfer: float, block: float,
                                                                exposed: float) -> None:
    assert float(ring_step_exposed(transfer, block, 1.0)) == pytest.approx(exposed)


def test_short_ring_blocks_on_slow_links_expose_the_exchange() -> None:
    """Over 1 GB/s links the KV blocks of 2,048-token chunks take longer than their attention; over
    NVLink-class links the same layout exposes nothing."""
    training = TrainingSpec(global_batch=1, seq_len=16384)
    config = ParallelConfig(tp=1, pp=1, dp=1, mbs=1, global_batch=1, cp=8)
    k = replace(get_stack("megatron").constants, cp_comm="p2p")
    slow = homogeneous_cluster("H100-80GB", 8, 1, 450e9, 1e9, name="slow")
    fast = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9, name="fast")
    assert PerfModel(ONE, training, config, slow, constants=k).estimate().breakdown[CP_PART] > 0
    assert PerfModel(ONE, training, config, fast, constants=k).estimate().breakdown[CP_PART] == 0


@pytest.mark.parametrize("stack", ["pipette", "nanotron"])
def test_a_stack_that_refuses_cp_says_so_in_one_line(stack: str) -> None:
    config = ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=2, cp=2)
    with pytest.raises(SpecError) as e:
        rank_layout(config, stack)
    assert "\n" not in str(e.value) and "cp=2" in str(e.value) and "issue 48" in str(e.value)


def test_each_stack_cites_its_cp_rule() -> None:
    assert stack_layout("megatron").cp_problems(2, 2, 8190, 64, 8)  # not a multiple of 2 cp tp
    assert not stack_layout("megatron").cp_problems(2, 2, 8192, 64, 8)
    ulysses = stack_layout("hf-deepspeed")
    assert ulysses.cp_kind == "ulysses"
    problems = ulysses.cp_problems(16, 1, 131072, 32, 8)  # 16 does not divide the 8 key/value heads
    assert len(problems) == 1 and "key/value" in problems[0][0]
    assert all(stack_layout(s).cp_source for s in ("megatron", "fsdp", "hf-deepspeed"))


def test_short_sequence_spaces_keep_their_candidates() -> None:
    """Below 4 h tokens (16,384 for an 8B model) a stack that runs cp enumerates what it did without
    cp; at a long sequence it adds cp layouts, each keeping at least h tokens a rank."""
    model = ModelSpec.preset("llama3-8b")
    short = TrainingSpec(global_batch=8, seq_len=8192, method="lora")
    before = enumerate_space(model, short, 8)
    after = enumerate_space(model, short, 8, stack="fsdp")
    assert [c.label for c in after.candidates] == [c.label for c in before.candidates]
    assert after.rejected == before.rejected
    long = replace(short, seq_len=CP_MIN_SEQ_PER_HIDDEN * model.hidden * 2)
    assert cp_degrees(model, long, 8, "fsdp") == [1, 2, 4, 8]
    assert cp_degrees(model, long, 8, "pipette") == [1]
    assert cp_degrees(model, replace(short, seq_len=16384), 32, "megatron") == [1, 2, 4]
    assert cp_degrees(model, replace(short, seq_len=16383), 32, "megatron") == [1]
    spaced = enumerate_space(model, long, 8, stack="fsdp")
    assert {c.cp for c in spaced.candidates} == {1, 2, 4, 8}
    assert len([c for c in spaced.candidates if c.cp == 1]) == len(before.candidates)


LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 131072, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def test_positions_are_read_with_the_rope_scaling() -> None:
    assert positions(LLAMA_31_8B) == 131072
    yarn = dict(LLAMA_31_8B, max_position_embeddings=32768,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert positions(yarn) == 131072
    linear = dict(LLAMA_31_8B, max_position_embeddings=16384, rope_scaling={"type": "linear", "factor": 8.0})
    assert positions(linear) == 16384  # no original length: nothing extended
    assert positions({k: v for k, v in LLAMA_31_8B.items() if k != "rope_scaling"}) == 131072


def test_a_model_whose_positions_do_not_reach_the_sequence_is_refused_in_one_line() -> None:
    llama3 = ModelSpec.from_hf_config(dict(LLAMA_31_8B, max_position_embeddings=8192, rope_scaling=None))
    with pytest.raises(SpecError) as e:
        check_recipe(llama3, TrainingSpec(global_batch=8, seq_len=131072, method="lora"))
    assert "\n" not in str(e.value) and "8192 positions" in str(e.value) and "rope_scaling" in str(e.value)
    check_recipe(ModelSpec.from_hf_config(LLAMA_31_8B), TrainingSpec(global_batch=8, seq_len=131072))


def test_each_device_prices_the_exchange_its_runner_makes() -> None:
    """The fsdp stack on CUDA: PyTorch's ring, all-gather rotation, K and V repeated to the query heads
    (torchtitan's Llama, the runner's ``torch_ring_attention``); on CPU ranks the runner's own ring of
    key/value blocks point to point (``workers.rank.ring_attention``); Megatron-Core's ring on both."""
    fsdp, megatron = get_stack("fsdp").memory_options, get_stack("megatron").memory_options
    assert fsdp.cp_exchange("gpu") == ("allgather", True)
    assert fsdp.cp_exchange("cpu") == ("p2p", False)
    assert megatron.cp_exchange("gpu") == megatron.cp_exchange("cpu") == ("p2p", False)
    training = TrainingSpec(global_batch=1, seq_len=32768)
    config = ParallelConfig(tp=1, pp=1, dp=1, mbs=1, global_batch=1, cp=4, zero_stage=3)
    gpu, cpu = (stage_breakdowns(ONE, training, config, options=fsdp, device_kind=k)[0]["buffers"]
                for k in ("gpu", "cpu"))
    assert gpu - cpu == pytest.approx(exchange_bytes(ONE, training, config, "allgather", repeat_kv=True)
                                      - exchange_bytes(ONE, training, config, "p2p"))
