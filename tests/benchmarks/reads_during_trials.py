"""Reads while a trial runs in the same ``pipette-admin serve`` (issue 43, item 9).

    ./dev bench reads_during_trials [--seconds 40] [--rate 20] [--trials 4]

Against a real ``serve`` (SQLite, its scheduler, a local Ray on 2 CPU devices): one client reads
a job, its trials and the job list at ``--rate`` requests/s for ``--seconds`` while nothing runs
(the baseline), then submits a job of tiny-llama trials and reads the same way from the submit to
the job's end (its planning, the local Ray's start, its trials). Prints p50/p99/max latency of
both phases and their ratio, and ``--json`` the same as JSON.
The latencies of one run are compared with each other: the machine's other load moves both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from service.migrations import upgrade  # noqa: E402
from tests.service.processes import ServiceProcess, admin_token  # noqa: E402

JOB = {"cluster": "local", "model": "tiny-llama",
       "training": {"global_batch": 8, "seq_len": 128, "dtype": "fp32", "method": "lora",
                    "lora": {"rank": 8, "alpha": 16}},
       "budget": {"max_trials": 4, "steps": 8, "retime": 0}}


def read_phase(client: httpx.Client, headers: dict[str, str], paths: list[str], seconds: float,
               rate: float, until: Any = None) -> list[float]:
    """Latencies (s) of reads at ``rate`` a second for ``seconds`` (or until ``until()``)."""
    out: list[float] = []
    started = time.monotonic()
    i = 0
    while time.monotonic() - started < seconds and not (until and until()):
        t = time.monotonic()
        r = client.get(paths[i % len(paths)], headers=headers)
        out.append(time.monotonic() - t)
        assert r.status_code == 200, r.text
        i += 1
        time.sleep(max(0.0, started + i / rate - time.monotonic()))
    return out


def clients(n: int, read: Any, base: str, watch: Any = None, done: threading.Event | None = None) -> list[float]:
    """``n`` clients (threads, a connection each) running ``read``; ``watch`` polled every
    second sets ``done`` when true. All their latencies."""
    out: list[float] = []

    def one() -> None:
        with httpx.Client(base_url=base, timeout=30) as c:
            out.extend(read(c))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if watch is not None and done is not None and watch():
            done.set()
        time.sleep(1.0)
    return out


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"n": len(ordered), "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_ms": 1000 * ordered[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--clients", type=int, default=1, help="reading clients, each at --rate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="pipette-reads-"))
    url = f"sqlite:///{home / 'reads.db'}"
    upgrade(url)
    service = ServiceProcess(url, home, args=("--no-access-log",), PIPETTE_POLL_S="0.5").start()
    try:
        headers = admin_token(url, home, "reads")
        with httpx.Client(base_url=service.base, timeout=30) as client:
            cluster = {"name": "local", "devices": args.devices}
            assert client.post("/v1/clusters", json=cluster, headers=headers).status_code == 201
            job = {**JOB, "budget": {**JOB["budget"], "max_trials": args.trials}}  # type: ignore[dict-item]
            # idle: the job list and the cluster; then, from the submit to the job's end (its
            # planning, Ray's start and its trials), the job's own pages
            idle_paths = ["/v1/jobs", "/v1/clusters", "/v1/clusters/local"]
            baseline = clients(args.clients, lambda c: read_phase(c, headers, idle_paths, args.seconds, args.rate),
                               service.base)
            job_id = client.post("/v1/jobs", json=job, headers=headers).json()["id"]

            def state() -> str:
                return str(client.get(f"/v1/jobs/{job_id}", headers=headers).json()["state"])

            busy_paths = [f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/trials", "/v1/jobs"]
            done = threading.Event()
            busy = clients(args.clients, lambda c: read_phase(c, headers, busy_paths, args.seconds, args.rate,
                                                              until=done.is_set), service.base,
                           watch=lambda: state() in ("succeeded", "failed", "cancelled"), done=done)
            final = state()
        result = {"baseline": summary(baseline), "during_trials": summary(busy), "job_state": final,
                  "load": os.getloadavg()}
        result["p99_ratio"] = result["during_trials"]["p99_ms"] / result["baseline"]["p99_ms"]  # type: ignore[index]
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            for phase in ("baseline", "during_trials"):
                s = result[phase]
                print(f"{phase:14s} n={s['n']:5d}  p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms"  # type: ignore[index]
                      f"  max {s['max_ms']:7.1f} ms")  # type: ignore[index]
            print(f"p99 during trials / idle: {result['p99_ratio']:.1f}x; job {final}; load {result['load']}")
        return 0
    finally:
        service.stop()


if __name__ == "__main__":
    sys.exit(main())
