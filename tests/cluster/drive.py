"""What the cluster tests run inside host 0 of the shaped cluster (a Ray driver must sit on
a Ray node: ``ip netns exec pcl-h0 python -m tests.cluster.drive ...``, ``RAY_ADDRESS`` set).

    probe --out profile.json                  the cluster probe across every Ray node
    trial --profile profile.json --spec trial.json
                                              one real trial, placed as the spec's config says

Output: one ``@@drive {json}`` line per event (``step``, then ``result``) on stdout, so the
test can act in the middle of a trial (kill a host) and read the outcome.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

PREFIX = "@@drive "


def emit(kind: str, **data: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps({"event": kind, **data}) + "\n")
    sys.stdout.flush()


def probe(out: Path, timeout_s: float) -> None:
    from pipette.model import ModelSpec
    from workers.host.probe import probe_cluster

    started = time.monotonic()
    profile = probe_cluster("shaped-4", cpu_devices_per_node=1, model=ModelSpec.preset("tiny-llama"),
                            timeout_s=timeout_s)
    out.write_text(json.dumps(profile.to_dict()))
    emit("result", seconds=time.monotonic() - started, nodes=[n.address for n in profile.nodes])


def trial(profile_path: Path, spec_path: Path, timeout_s: float) -> None:
    from pipette.clusterfile import cluster_from_dict
    from workers.host.executor import StepReport, run_trial
    from workers.spec import TrialSpec

    cluster = cluster_from_dict(json.loads(profile_path.read_text()))
    spec = TrialSpec.from_candidate(json.loads(spec_path.read_text()))

    def on_step(report: StepReport) -> bool:
        emit("step", step=report.step, time=report.time, warmup=report.warmup, elapsed=report.elapsed,
             pids=list(report.pids))
        return False

    started = time.monotonic()
    try:
        m = run_trial(spec, cluster, timeout_s=timeout_s, on_step=on_step)
    except Exception as e:  # reported, so the test sees what escaped run_trial and how
        emit("raised", type=type(e).__name__, error=str(e)[-4000:], seconds=time.monotonic() - started)
        raise
    emit("result", seconds=time.monotonic() - started, measurement=m.to_dict())


def main() -> int:
    parser = argparse.ArgumentParser(prog="tests.cluster.drive")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=240.0)
    t = sub.add_parser("trial")
    t.add_argument("--profile", type=Path, required=True)
    t.add_argument("--spec", type=Path, required=True)
    t.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()
    if args.cmd == "probe":
        probe(args.out, args.timeout)
    else:
        trial(args.profile, args.spec, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
