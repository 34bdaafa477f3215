"""Pipette on a real multi-host Ray cluster whose links really differ (issue 8).

Four hosts (network namespaces, ``tests/cluster/shaped.py``), one CPU device each, joined by
a bridge and shaped per destination: {0,1} and {2,3} at 1000 Mbit/s, across the pairs 100,
and 1 <-> 3 degraded to 30. Shown by measurement:

1. the cluster probe, run through Ray across the hosts, recovers the shaped matrix (the probe
   the service's scheduler ran, ``conftest.profiled``: one probe a session);
2. on a communication-heavy job the placement Pipette chooses beats rank order (what a user
   gets without Pipette) with the same degrees, and the model predicts both.

Losing a host in the middle of a trial (it ends ``failed`` naming the node, within a minute:
nothing hangs) is shown on the tuning job of ``test_service_on_cluster.py``, whose trial loses one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipette.clusterfile import cluster_from_dict
from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.perf import PerfModel
from pipette.placement import naive_placement, optimize_placement
from pipette.training import TrainingSpec
from tests.cluster.conftest import drive
from tests.cluster.shaped import MBIT, ShapedCluster, namespace_of
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow]

#: the probe's bandwidth may differ from the shaped rate by this much: TCP and HTB overheads,
#: and at 1 Gbit/s the busy cores themselves (766 of 1000 once, at load ~15)
PROBE_TOLERANCE = 0.25
#: the step-time model's stated error (docs/results.md: throughput MAPE 33.9% on the
#: Ultra-Scale "healthy" rows, its widest stated figure). It is asserted on what a placement
#: changes, the time the chosen placement saves over rank order; the absolute step times are
#: printed against it but not asserted: CPU ranks sharing 2 cores with other jobs carry a
#: load-dependent overhead the analytic model does not price (-20% to -56% over five runs, see
#: docs/deployment.md), which the tuner's learned correction absorbs.
STATED_ERROR = 0.339
#: chosen vs rank order must differ by at least this factor to count as "measurably faster"
MIN_SPEEDUP = 1.5

# A job whose gradient all-reduce dominates its step: 2.6 M parameters (10.5 MB of fp32
# gradients, full fine-tuning) against a few ms of compute per micro-batch.
MODEL = ModelSpec(name="wide-tiny-llama", layers=2, hidden=256, heads=4, kv_heads=4, ffn_hidden=688, vocab=2048,
                  max_seq=256)
TRAINING = TrainingSpec(global_batch=4, seq_len=32, dtype="fp32", method="full")
DEGREES = ParallelConfig(tp=2, pp=1, dp=2, mbs=2, global_batch=4, zero_stage=0)


def _spec_file(tmp_path: Path, name: str, config: ParallelConfig, **options: Any) -> Path:
    kwargs = {"warmup_steps": 2, "min_steps": 4, "max_steps": 6} | options
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(TrialSpec(MODEL, TRAINING, config, **kwargs).candidate()))
    return path


def _locate_ranks(where: dict[int, str]) -> Callable[[dict[str, Any]], None]:
    """At the first step, while the ranks run: the network namespace of each rank's process."""
    def locate(event: dict[str, Any]) -> None:
        if event["event"] == "step" and not where:
            where.update({rank: namespace_of(pid) for rank, pid in enumerate(event["pids"])})
    return locate


@pytest.mark.timeout(900)
def test_probe_recovers_the_shaped_links(cluster: ShapedCluster, probed: tuple[Path, float]) -> None:
    path, seconds = probed
    profile = cluster_from_dict(json.loads(path.read_text()))
    assert [n.address for n in profile.nodes] == [cluster.address(h) for h in range(cluster.hosts)]
    assert [d.node for d in profile.devices] == list(range(cluster.hosts))  # one device per host
    print(f"\nprobe across {cluster.hosts} hosts: {seconds:.1f} s")
    print("pair   set Mbit/s   measured Mbit/s   error")
    errors = {}
    for a in range(cluster.hosts):
        for b in range(a + 1, cluster.hosts):
            measured = float(profile.bandwidth[a, b]) / MBIT
            errors[(a, b)] = measured / cluster.mbit(a, b) - 1
            print(f"{a}<->{b}   {cluster.mbit(a, b):10.0f}   {measured:15.1f}   {errors[(a, b)]:+6.1%}")
    assert all(abs(e) <= PROBE_TOLERANCE for e in errors.values()), errors
    # The degraded link is found: it is the slowest measured pair.
    off = np.where(np.eye(cluster.hosts, dtype=bool), np.inf, profile.bandwidth)
    slowest = np.unravel_index(int(np.argmin(off)), off.shape)
    assert sorted(int(x) for x in slowest) == [1, 3]


@pytest.mark.timeout(900)
def test_chosen_placement_beats_rank_order(
    cluster: ShapedCluster, probed: tuple[Path, float], tmp_path: Path
) -> None:
    profile = cluster_from_dict(json.loads(probed[0].read_text()))
    perf = PerfModel(MODEL, TRAINING, DEGREES, profile)
    # What make_plan does for its top candidates: the placement search on the probed matrix.
    chosen = optimize_placement(DEGREES, profile, perf.step_time).placement
    naive = naive_placement(DEGREES)
    assert chosen != naive
    rows = {}
    for name, placement in (("chosen", chosen), ("rank order", naive)):
        config = DEGREES.with_placement(placement)
        where: dict[int, str] = {}
        run = drive(cluster, ["trial", "--profile", str(probed[0]), "--spec",
                              str(_spec_file(tmp_path, name.replace(" ", "-"), config)), "--timeout", "400"],
                    timeout_s=600, on_event=_locate_ranks(where))
        m = run.result["measurement"]
        assert m["status"] == "ok", m["error"][-3000:]
        # Each rank ran in the namespace of the host its placement names.
        assert where == {r: cluster.ns(profile.devices[d].node) for r, d in enumerate(placement)}, where
        predicted = perf.estimate(np.array(placement)).step_time
        rows[name] = (placement, predicted, float(m["step_time"]), run.result["seconds"])
    print(f"\n{DEGREES.label} on the shaped cluster ({MODEL.name}, full fine-tuning, fp32):")
    print("placement    devices       predicted s   measured s   error     trial s")
    for name, (placement, predicted, measured, seconds) in rows.items():
        print(f"{name:11}  {placement!s:12}  {predicted:11.3f}   {measured:10.3f}   {predicted / measured - 1:+6.1%}"
              f"   {seconds:6.1f}")
    ratio = rows["rank order"][2] / rows["chosen"][2]
    predicted_ratio = rows["rank order"][1] / rows["chosen"][1]
    print(f"speed-up measured {ratio:.2f}x, predicted {predicted_ratio:.2f}x")
    errors = {name: abs(predicted - measured) / measured for name, (_, predicted, measured, _) in rows.items()}
    print(f"step time within the stated error ({STATED_ERROR:.1%}): "
          + ", ".join(f"{name} {'yes' if e <= STATED_ERROR else 'no'}" for name, e in errors.items()))
    saved = rows["rank order"][2] - rows["chosen"][2]
    saved_predicted = rows["rank order"][1] - rows["chosen"][1]
    print(f"time saved by the placement: measured {saved:.3f} s, predicted {saved_predicted:.3f} s "
          f"({saved_predicted / saved - 1:+.1%})")
    assert ratio >= MIN_SPEEDUP
    assert abs(saved_predicted - saved) / saved <= STATED_ERROR
