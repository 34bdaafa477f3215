"""PyTorch's ring attention as torchtitan runs it (issue 48; pipette.perf_cp): the ring steps after the
first attend without the causal mask at FlashAttention-2's measured full-over-causal rate
(pipette.kernel_tables, derived from data/kernels/flash_attention.csv), the fp32 merges and
accumulations beside the kernels, K and V repeated to the query heads, and the KV gradient's last send,
which nothing hides."""

from __future__ import annotations

import csv
from dataclasses import replace

import numpy as np
import pytest

from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.kernel_tables import FLASH_FULL_OVER_CAUSAL
from pipette.memory_cp import kv_block_bytes
from pipette.model import ModelSpec
from pipette.perf_compute import Compute
from pipette.perf_cp import (
    exchanged_kv_bytes,
    full_over_causal,
    layer_exposed,
    recomputes_attention,
    ring_compute,
    with_ring,
)
from pipette.stacks import FSDP_COMPILE_ELEMENTWISE_SHARE, FSDP_CONSTANTS, FSDP_CPU_CONSTANTS, get_stack
from pipette.training import TrainingSpec
from tests.benchmarks import kernel_tables

#: one Llama layer, 8 query and 2 key/value heads of 64
ONE = ModelSpec(name="one-layer", layers=1, hidden=512, heads=8, kv_heads=2, ffn_hidden=1024, vocab=1000,
                max_seq=1 << 20, arch="llama")
H100 = DeviceSpec.preset("H100-80GB")


def _job(cp: int, s: int = 32768, recompute: str = "none") -> tuple[TrainingSpec, ParallelConfig]:
    return TrainingSpec(global_batch=1, seq_len=s), ParallelConfig(tp=1, pp=1, dp=1, mbs=1, global_batch=1, cp=cp,
                                                                   recompute=recompute)


def test_the_table_is_derived_from_the_carried_timings() -> None:
    with open(kernel_tables.CARRIED_FLASH, newline="") as f:
        rows = [r for r in csv.DictReader(f) if kernel_tables.kept_flash(r)]
    derived = kernel_tables.full_over_causal(rows)
    assert {f: {d: tuple((s, round(x, 3)) for s, x in pts) for d, pts in by.items()} for f, by in derived.items()} \
        == FLASH_FULL_OVER_CAUSAL
    assert sum(r["pass"] == "fwd+bwd" for r in rows) == 45  # FlashAttention's README; beside it 12 B200 SDPA timings


def test_full_over_causal_reads_the_measured_ratio_and_holds_it_at_the_ends() -> None:
    assert full_over_causal(H100, 128, 16384) == pytest.approx(338 / 328, abs=1e-3)  # FA2's README, H100
    assert full_over_causal(H100, 128, 1 << 20) == full_over_causal(H100, 128, 16384)
    mid = full_over_causal(H100, 128, 8192 * 2 ** 0.5)
    assert min(1.030, 1.088) < mid < max(1.030, 1.088)
    assert full_over_causal(H100, 96, 2048) == full_over_causal(H100, 64, 2048)  # the nearer head size
    assert full_over_causal(DeviceSpec.preset("B200-180GB"), 128, 16384) == 1.0  # none timed


def test_torchtitan_repeats_k_and_v_to_the_query_heads_pipettes_cpu_ring_does_not() -> None:
    training, config = _job(4)
    assert exchanged_kv_bytes(ONE, training, config, FSDP_CONSTANTS) == 4 * kv_block_bytes(ONE, training, config)
    assert exchanged_kv_bytes(ONE, training, config, FSDP_CPU_CONSTANTS) == kv_block_bytes(ONE, training, config)


def test_the_ring_passes_by_hand() -> None:
    """cp 2, bf16, K and V repeated (KV = O = 16384 x 512 elements): forward 2 casts + one merged step
    (6 + 38) + one K,V copy (2 x 4) = 58 O bytes; backward 4 + 2 x 10 + 6 = 30 O and
    8 + 20 + (10 + 16) + 2 x 16 + 8 + 12 = 106 KV bytes; the second step's attention saved."""
    training, config = _job(2)
    k = replace(FSDP_CONSTANTS, ring_pass_share=1.0)
    o = 16384 * 512
    attn = (1.0, 2.5)
    saved = 0.5 * (1 - 1 / full_over_causal(H100, 64, 8192))
    fwd, bwd = ring_compute(ONE, training, config, k, H100, attn)
    assert fwd == pytest.approx(-saved * 1.0 + 58 * o / H100.memory_bandwidth)
    assert bwd == pytest.approx(-saved * 2.5 + (30 + 106) * o / H100.memory_bandwidth)
    compiled = replace(k, ring_pass_share=0.0)
    assert ring_compute(ONE, training, config, compiled, H100, attn) == pytest.approx((-saved, -saved * 2.5))
    assert ring_compute(ONE, training, config, replace(k, cp_comm="p2p"), H100, attn) == (0.0, 0.0)
    assert ring_compute(ONE, *_job(1), k, H100, attn) == (0.0, 0.0)


def test_torchtitans_compile_leaves_the_ring_passes_as_its_other_elementwise_passes() -> None:
    assert get_stack("fsdp+compile").constants.ring_pass_share == FSDP_COMPILE_ELEMENTWISE_SHARE
    assert get_stack("fsdp").constants.ring_pass_share == 1.0


def test_the_last_kv_gradient_send_is_exposed_however_long_the_blocks() -> None:
    training, config = _job(4)
    k = FSDP_CONSTANTS
    bw, lat = np.array([100e9]), np.array([0.0])
    long = layer_exposed(ONE, training, config, k, (10.0, 25.0), bw, lat)
    dkv = exchanged_kv_bytes(ONE, training, config, k) * 2 / (bw[0] * k.link_fraction)  # fp32
    assert float(long[0]) == pytest.approx(dkv)
    short = layer_exposed(ONE, training, config, k, (1e-6, 2.5e-6), bw, lat)
    assert float(short[0]) > 4 * dkv  # short blocks hide neither the gathers nor the other sends


@pytest.mark.parametrize(("recompute", "op_sac", "again"), [("full", 0.0, True), ("selective", 0.0, True),
                                                           ("selective", 0.5, False), ("none", 0.0, False)])
def test_the_backward_pays_the_rings_forward_again_where_it_reruns_the_attention(recompute: str, op_sac: float,
                                                                                 again: bool) -> None:
    training, config = _job(4, recompute=recompute)
    k = replace(FSDP_CONSTANTS, op_sac_linear_share=op_sac, ring_pass_share=1.0)
    assert recomputes_attention(config, k) is again
    base = Compute(forward=np.array([1.0]), backward=np.array([2.0]), linear=np.array([0.5]), attention=(0.1, 0.25))
    fwd, bwd = ring_compute(ONE, training, config, k, H100, base.attention)
    out = with_ring(base, ONE, training, config, k, H100, np.array([3.0]))
    assert float(out.forward[0]) == pytest.approx(1.0 + 3 * fwd)
    assert float(out.backward[0]) == pytest.approx(2.0 + 3 * (bwd + (fwd if again else 0.0)))


def test_ulysses_all_to_alls_wrap_the_core_attention_so_only_full_recomputation_repeats_them() -> None:
    k = replace(FSDP_CONSTANTS, cp_comm="a2a")
    bw, lat = np.array([100e9]), np.array([0.0])
    none, selective, full = (layer_exposed(ONE, *_job(4, recompute=r), k, (1.0, 2.5), bw, lat)[0]
                             for r in ("none", "selective", "full"))
    assert selective == none and full == pytest.approx(1.5 * none)
