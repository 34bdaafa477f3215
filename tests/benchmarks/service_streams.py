"""Idle event streams of one tenant against another tenant's reads (issue 32, item 12).

    .venv/bin/python tests/benchmarks/service_streams.py [--streams 300] [--seconds 20] [--rate 10]

Against a real ``pipette-admin serve`` (scheduler off) on a throwaway database of the local
PostgreSQL (127.0.0.1:5432), as ``service_load.py``: tenant A has one queued job (no events:
its streams stay idle); tenant B reads one of its own jobs ``--rate`` times a second.

1. B reads for ``--seconds`` with no stream open: p50/p99 and the service's CPU.
2. A opens ``--streams`` event streams of its job at once (one connection each), counted by
   status: 200 (open) and 429 (over ``PIPETTE_MAX_STREAMS_PER_TENANT`` / ``PIPETTE_MAX_STREAMS``).
3. B reads again for ``--seconds`` while A's accepted streams stay open: p50/p99, the
   service's CPU, and how many of A's streams are still open at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.service_load import (  # noqa: E402
    JOB,
    Connection,
    _cpu_s,
    _free_port,
    _stats,
    _token,
    _wait_healthy,
    scratch_database,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=10.0, help="tenant B's reads per second")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with scratch_database("pipette_streams") as (name, url):
        report = _serve_and_stream(args, name, url)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


def _serve_and_stream(args: argparse.Namespace, name: str, url: str) -> dict[str, Any]:
    service: subprocess.Popen[bytes] | None = None
    try:
        a, b = _token(url), _tenant_token(url, "reader")  # tenant "load" streams, "reader" reads
        port = _free_port()
        env = {**os.environ, "PIPETTE_DATABASE_URL": url, "PIPETTE_SCHEDULER": "0", "PYTHONPATH": str(ROOT)}
        log = open(Path(tempfile.gettempdir()) / f"{name}.log", "wb")
        service = subprocess.Popen([sys.executable, "-m", "service.admin", "serve", "--port", str(port),
                                    "--no-access-log"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base)
        report = asyncio.run(_run(port, a, b, args, service.pid))
    finally:
        if service is not None:
            service.terminate()
            service.wait(60)
    return report


def _tenant_token(url: str, tenant: str) -> dict[str, str]:
    from service.auth import create_token
    from service.db import Database

    db = Database(url)
    with db.write() as session:
        _, secret = create_token(session, tenant)
    db.dispose()
    return {"Authorization": f"Bearer {secret}"}


async def _job(port: int, headers: dict[str, str]) -> str:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as client:
        (await client.post("/v1/clusters", json={"name": "local", "devices": 4})).raise_for_status()
        r = await client.post("/v1/jobs", json=JOB)
        r.raise_for_status()
        return str(r.json()["id"])


async def _reads(port: int, headers: dict[str, str], job: str, seconds: float, rate: float) -> dict[str, Any]:
    conn = Connection("127.0.0.1", port, headers)
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    deadline = start + seconds
    n = 0
    while time.perf_counter() < deadline:
        n += 1
        t = time.perf_counter()
        try:
            ok = await conn.get(f"/v1/jobs/{job}") == 200
        except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration):
            ok = False
            await conn.close()
        latencies.append(time.perf_counter() - t)
        errors += not ok
        await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
    await conn.close()
    return _stats(latencies, errors, time.perf_counter() - start)


async def _open_stream(port: int, headers: dict[str, str], job: str) -> tuple[int, asyncio.StreamWriter | None,
                                                                                   asyncio.StreamReader | None]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"GET /v1/jobs/{job}/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n{extra}\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        writer.close()
        return status, None, None
    return status, writer, reader


async def _run(port: int, a: dict[str, str], b: dict[str, str], args: argparse.Namespace, pid: int) -> dict[str, Any]:
    job_a, job_b = await _job(port, a), await _job(port, b)
    cpu = _cpu_s(pid)
    quiet = await _reads(port, b, job_b, args.seconds, args.rate)
    quiet["service_cpu_s"] = _cpu_s(pid) - cpu
    opened = await asyncio.gather(*(_open_stream(port, a, job_a) for _ in range(args.streams)),
                                  return_exceptions=True)
    statuses: dict[str, int] = {}
    streams = []
    for item in opened:
        key = type(item).__name__ if isinstance(item, BaseException) else str(item[0])
        statuses[key] = statuses.get(key, 0) + 1
        if not isinstance(item, BaseException) and item[1] is not None:
            streams.append(item)
    cpu = _cpu_s(pid)
    busy = await _reads(port, b, job_b, args.seconds, args.rate)
    busy["service_cpu_s"] = _cpu_s(pid) - cpu
    still_open = sum(not r.at_eof() for _, _, r in streams if r is not None)
    for _, w, _ in streams:
        if w is not None:
            w.close()
    return {"machine": f"{os.cpu_count()} cores", "load_average": os.getloadavg(), "streams_asked": args.streams,
            "stream_answers": statuses, "streams_open_at_end": still_open, "reads_without_streams": quiet,
            "reads_with_streams": busy, "seconds": args.seconds, "rate": args.rate}


def _print(r: dict[str, Any]) -> None:
    print(f"{r['machine']}; load average after: " + " ".join(f"{x:.1f}" for x in r["load_average"]))
    print(f"{r['streams_asked']} streams asked by one tenant: {r['stream_answers']}; "
          f"{r['streams_open_at_end']} still open at the end")
    for key in ("reads_without_streams", "reads_with_streams"):
        x = r[key]
        print(f"  {key:<22} {x['requests']} reads  p50 {x['p50_ms']:.1f} ms  p99 {x['p99_ms']:.1f} ms  "
              f"errors {x['errors']}  service CPU {x['service_cpu_s']:.2f} s in {r['seconds']:.0f} s "
              f"({x['service_cpu_s'] / r['seconds']:.2f} core)")


if __name__ == "__main__":
    sys.exit(main())
