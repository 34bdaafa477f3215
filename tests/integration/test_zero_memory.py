"""The DeepSpeed runner's measured live peak on CPU ranks against the pipette stack's estimate
(``MemoryOptions.deepspeed_zero``): real DeepSpeed ZeRO-0/1 steps on 2 gloo ranks, dense and
Mixture-of-Experts under AutoEP. Before the ZeRO terms were counted the estimate was 23-47% under on
the ZeRO-1 layouts here (the master clone and the two reduce buffers missing)."""

from __future__ import annotations

import pytest

from pipette.config import ParallelConfig
from pipette.memory import estimate_memory
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.host.local import run_local
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
#: the estimate against the trials (2-core VM, 2026-12-05): the ep 1 layouts' peaks repeat to the byte
#: (tiny-llama ZeRO-1 25.78 MiB, tiny-moe 65.90 on every run), -0.3% to -2.4% from the estimate
TOLERANCE = 0.10
#: under AutoEP one rank's peak varies from run to run: ZeRO-1 at ep 2 58.2-61.0 MiB over the 8 ranks of 4
#: idle runs, 62.6 in a clean-clone suite beside other tests (the estimate, 56.1, 3.5-10.3% under)
AUTOEP_TOLERANCE = 0.15


@pytest.mark.parametrize(("model", "zero", "ep"), [
    ("tiny-llama", 1, 1), ("tiny-moe", 0, 1), ("tiny-moe", 1, 1), ("tiny-moe", 1, 2),
])
def test_the_estimate_is_the_runners_measured_peak(model: str, zero: int, ep: int) -> None:
    spec = ModelSpec.preset(model)
    training = TrainingSpec(global_batch=8, seq_len=128, dtype="fp32")
    config = ParallelConfig(tp=1, pp=1, dp=2, ep=ep, mbs=1, global_batch=8, zero_stage=zero)
    m = run_local(TrialSpec(spec, training, config, warmup_steps=2, min_steps=2, max_steps=2), timeout_s=300)
    assert m.status == "ok", m.error
    estimate = estimate_memory(spec, training, config, 2**36, device_kind="cpu", stack="pipette")
    live = estimate.peak_bytes - estimate.breakdown["overhead"]  # the process's own bytes are no tensor's
    measured = max(m.peak_memory)
    tolerance = AUTOEP_TOLERANCE if ep > 1 else TOLERANCE
    assert abs(live / measured - 1) <= tolerance, (live / 2**20, measured / 2**20, estimate.breakdown)
