"""Load benchmark of the service on PostgreSQL: job submissions, then many clients reading.

    ./dev bench service_load [--clients 200] [--seconds 30] [--think 1.0] [--submissions 50] [--workers 1]
                             [--serve-args '--http h11 --loop asyncio']

What it does, against a real ``pipette-admin serve`` process (scheduler off: nothing runs
trials) on a throwaway database of the local PostgreSQL (127.0.0.1:5432):

1. ``--submissions`` jobs submitted at once (one client each): ``POST /v1/jobs``.
2. Each job gets 8 trial rows of realistic size (the tuner's ``TrialRecord`` dicts of real
   planned candidates of tiny-llama on 4 CPU devices; their measurements are synthetic:
   the payload matters here, not the numbers).
3. ``--clients`` clients (one keep-alive connection each) for ``--seconds``, each in a loop:
   read the job list, one job, or one job's trials (a third each), then wait ``--think``
   seconds (a dashboard polling);
   ``--think 0`` is a closed loop (as fast as the service answers).

It prints p50/p99 latency, throughput and errors (a non-2xx answer or a failed request) per
phase, and the same as JSON with ``--json``. The clients run in this process, on the same
machine as the service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PG_ADMIN = os.environ.get("PIPETTE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
JOB = {
    "cluster": "local", "model": "tiny-llama",
    "training": {"global_batch": 16, "seq_len": 128, "dtype": "fp32", "method": "lora"},
    "budget": {"max_trials": 8},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--think", type=float, default=1.0, help="seconds each client waits between reads")
    parser.add_argument("--submissions", type=int, default=50)
    parser.add_argument("--workers", type=int, default=1, help="API processes (pipette-admin serve --workers)")
    parser.add_argument("--serve-args", default="", help="more arguments for pipette-admin serve, e.g. "
                        "'--http h11 --loop asyncio' (the pure-Python stack) to compare with the default")
    parser.add_argument("--repo", type=Path, default=ROOT,
                        help="serve the API of another checkout (same schema), e.g. a worktree of an older commit, "
                             "to compare before and after in one sitting")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with scratch_database("pipette_load") as (name, url):
        report = _serve_and_load(args, name, url)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


@contextlib.contextmanager
def scratch_database(prefix: str) -> Iterator[tuple[str, str]]:
    """A new PostgreSQL database, migrated, dropped after (its name and URL)."""
    from sqlalchemy import create_engine, text

    from service.migrations import upgrade

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    try:
        upgrade(url)
        yield name, url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _serve_and_load(args: argparse.Namespace, name: str, url: str) -> dict[str, Any]:
    service: subprocess.Popen[bytes] | None = None
    try:
        headers = _token(url)
        port = _free_port()
        # every submission is queued (nothing runs trials): the per-tenant limit on queued work
        # must let them all in
        env = {**os.environ, "PIPETTE_DATABASE_URL": url, "PIPETTE_SCHEDULER": "0", "PYTHONPATH": str(args.repo),
               "PIPETTE_MAX_QUEUED_PER_TENANT": str(max(20, args.submissions))}
        log_path = Path(tempfile.gettempdir()) / f"{name}.log"
        log = open(log_path, "wb")
        service = subprocess.Popen([sys.executable, "-m", "service.admin", "serve", "--port", str(port),
                                    "--workers", str(args.workers), *args.serve_args.split()],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, cwd=args.repo)
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base)
        try:  # uvloop makes the clients cheaper when it is there (uvicorn[standard] brings it)
            import uvloop

            report: dict[str, Any] = uvloop.run(_run(base, headers, url, args, service.pid))
        except ImportError:
            report = asyncio.run(_run(base, headers, url, args, service.pid))
    finally:
        if service is not None:
            service.terminate()
            service.wait(60)
    return report


async def _run(base: str, headers: dict[str, str], url: str, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=max(args.clients, args.submissions), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30, limits=limits) as client:
        r = await client.post("/v1/clusters", json={"name": "local", "devices": 4})
        r.raise_for_status()
        submit = await _submissions(client, args.submissions)
        job_ids = [j for j in submit.pop("ids") if j]
        _seed_trials(url, job_ids)
        before = (_cpu_s(os.getpid()), _cpu_s(pid, children=True))
        reads = await _reads(base, headers, job_ids, args.clients, args.seconds, args.think)
        # Where the two cores went during the reads: the clients run here, beside the service.
        reads["cpu_s"] = {"clients": _cpu_s(os.getpid()) - before[0],
                          "service": _cpu_s(pid, children=True) - before[1]}
    return {"machine": f"{os.cpu_count()} cores", "database": "PostgreSQL (local)",
            "submissions": submit, "reads": reads,
            "settings": {"clients": args.clients, "seconds": args.seconds, "think_s": args.think,
                         "api_processes": args.workers, "serve_args": args.serve_args,
                         "served": _commit(args.repo)}, "load_average": os.getloadavg()}


def _commit(repo: Path) -> str:
    """The served checkout and its commit (``--repo``)."""
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{repo} at {head.stdout.strip() or 'an unknown commit'}"


async def _submissions(client: httpx.AsyncClient, n: int) -> dict[str, Any]:
    async def one() -> tuple[float, bool, str | None]:
        start = time.perf_counter()
        try:
            r = await client.post("/v1/jobs", json=JOB)
            ok = r.status_code == 202
            return time.perf_counter() - start, ok, r.json()["id"] if ok else None
        except httpx.HTTPError:
            return time.perf_counter() - start, False, None

    start = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - start
    return {**_stats([t for t, _, _ in results], sum(not ok for _, ok, _ in results), wall),
            "ids": [i for _, _, i in results]}


class Connection:
    """One keep-alive HTTP/1.1 connection that sends GETs and reads ``Content-Length`` answers.

    The readers use this instead of httpx: at 200 connections httpx spent about 7 ms of CPU per
    request in this process (more than the service itself, on the same two cores), so it
    measured the client. This costs a fraction of a millisecond."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.extra}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(int(line.split(":", 1)[1]) for line in lines[1:] if line.lower().startswith("content-length:"))
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def _reads(base: str, headers: dict[str, str], job_ids: list[str], clients: int, seconds: float,
                 think: float) -> dict[str, Any]:
    host, port = base.removeprefix("http://").split(":")
    latencies: dict[str, list[float]] = {"list": [], "job": [], "trials": []}
    errors: list[str] = []
    deadline = time.perf_counter() + seconds

    async def reader(seed: int) -> None:
        rng = random.Random(seed)
        conn = Connection(host, int(port), headers)
        await asyncio.sleep(rng.random() * max(think, 0.05))  # spread the starts
        while time.perf_counter() < deadline:
            kind = rng.choice(("list", "job", "trials"))
            job = rng.choice(job_ids)
            path = {"list": "/v1/jobs?limit=20", "job": f"/v1/jobs/{job}", "trials": f"/v1/jobs/{job}/trials"}[kind]
            start = time.perf_counter()
            try:
                status = await conn.get(path)
                ok, detail = status == 200, f"{status} {path}"
            except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration) as e:
                ok, detail = False, f"{type(e).__name__} {path}"
                await conn.close()
            latencies[kind].append(time.perf_counter() - start)
            if not ok:
                errors.append(detail)
            if think:
                await asyncio.sleep(think * (0.5 + rng.random()))
        await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(reader(i) for i in range(clients)))
    wall = time.perf_counter() - start
    everything = [t for values in latencies.values() for t in values]
    out: dict[str, Any] = {"all": _stats(everything, len(errors), wall)}
    for kind, values in latencies.items():
        out[kind] = _stats(values, 0, wall)
    out["error_examples"] = errors[:5]
    return out


def _stats(values: list[float], errors: int, wall: float) -> dict[str, Any]:
    if not values:
        return {"requests": 0, "errors": errors}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"requests": len(values), "errors": errors, "p50_ms": 1000 * statistics.median(values),
            "p99_ms": 1000 * q[98], "max_ms": 1000 * max(values), "per_s": len(values) / wall}


def _cpu_s(pid: int, children: bool = False) -> float:
    """CPU seconds used by ``pid`` (and, with ``children``, its worker processes) so far."""
    pids = [pid]
    if children:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    total = 0.0
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _seed_trials(url: str, job_ids: list[str]) -> None:
    """Eight trial rows per job: TrialRecord dicts of real planned candidates (see the docstring)."""
    from pipette.clusterfile import load_cluster
    from pipette.measurement import Measurement
    from pipette.model import ModelSpec
    from pipette.plan import make_plan
    from pipette.training import TrainingSpec
    from pipette.trials import TrialRecord
    from service.db import Database
    from service.repositories import trials

    model = ModelSpec.preset("tiny-llama")
    training = TrainingSpec.from_dict(JOB["training"])  # type: ignore[arg-type]
    plan = make_plan(model, training, load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml"))
    db = Database(url)
    rng = random.Random(0)
    for job_id in job_ids:
        with db.write() as session:
            for number, planned in enumerate(plan.ranked[:8]):
                steps = tuple(planned.perf.step_time * (1 + 0.1 * rng.random()) for _ in range(8))
                m = Measurement("ok", steps, training.tokens_per_step, (2**28,) * 4, tuple([6.0] * 10))
                record = TrialRecord(number, planned.config, m, planned.perf, planned.memory, planned.perf.step_time)
                trials.start_trial(session, job_id, number, label=planned.config.label,
                                   config=planned.config.to_dict(), predicted_step_time=planned.perf.step_time)
                trials.SqlTrialStore(session, job_id).append(record)
    db.dispose()


def _token(url: str) -> dict[str, str]:
    from service.auth import create_token
    from service.db import Database

    db = Database(url)
    with db.write() as session:
        _, secret = create_token(session, "load")
    db.dispose()
    return {"Authorization": f"Bearer {secret}"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(base: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the service on {base} did not start (see its log in the temp folder)")


def _print(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(f"service load on {report['machine']}, {report['database']}, "
          f"{s['api_processes']} API process(es) {s.get('serve_args') or ''}; load average after: "
          + " ".join(f"{x:.1f}" for x in report["load_average"]))
    sub = report["submissions"]
    print(f"{sub['requests']} job submissions at once: p50 {sub['p50_ms']:.1f} ms, p99 {sub['p99_ms']:.1f} ms, "
          f"max {sub['max_ms']:.1f} ms, errors {sub['errors']}")
    print(f"{s['clients']} clients reading for {s['seconds']:.0f} s (think {s['think_s']} s):")
    for kind in ("all", "list", "job", "trials"):
        r = report["reads"][kind]
        if r["requests"]:
            print(f"  {kind:<7} {r['requests']:>7} requests  {r['per_s']:>7.1f}/s  p50 {r['p50_ms']:>7.1f} ms  "
                  f"p99 {r['p99_ms']:>7.1f} ms  max {r['max_ms']:>7.1f} ms  errors {r['errors']}")
    cpu = report["reads"]["cpu_s"]
    served = report["reads"]["all"]["requests"]
    print(f"  CPU during the reads: clients {cpu['clients']:.1f} s, service {cpu['service']:.1f} s "
          f"(of {2 * s['seconds']:.0f} core-seconds): {1000 * cpu['service'] / max(1, served):.2f} ms of the "
          f"service's CPU per read")
    print(f"  served: {s.get('served', '?')}")
    if report["reads"]["error_examples"]:
        print("  errors, e.g.:", "; ".join(report["reads"]["error_examples"]))


if __name__ == "__main__":
    sys.exit(main())
