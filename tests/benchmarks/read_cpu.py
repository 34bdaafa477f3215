"""CPU of the three polled reads, in-process: the app on PostgreSQL without an HTTP server.

    PYTHONPATH=$PWD python tests/benchmarks/read_cpu.py [--reads 300] [--jobs 20] [--profile list|job|trials]

A throwaway PostgreSQL database (as ``service_load.py``: 20 queued jobs, 8 trial rows each of
real planned candidates), the app called through httpx's ASGI transport (routing, the
dependencies, the thread-pool hop of a sync route, serialization: what a uvicorn worker does
minus the HTTP parsing). For each read (``GET /v1/jobs?limit=20``, ``GET /v1/jobs/{id}``,
``GET /v1/jobs/{id}/trials``) it prints the process CPU per request (``time.process_time``:
this process is client and server), and with ``--profile`` the top of a cProfile of one read.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.service_load import JOB, _seed_trials, _token, scratch_database  # noqa: E402


async def _measure(app: object, headers: dict[str, str], reads: int, jobs: int,
                   profile: str | None) -> dict[str, float]:
    if profile:  # cProfile sees one thread: run the sync routes inline, not in the thread pool
        import fastapi.dependencies.utils
        import fastapi.routing

        async def inline(func, *args, **kwargs):  # type: ignore[no-untyped-def]
            return func(*args, **kwargs)

        fastapi.routing.run_in_threadpool = inline  # type: ignore[assignment]
        fastapi.dependencies.utils.run_in_threadpool = inline  # type: ignore[assignment]
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
        (await client.post("/v1/clusters", json={"name": "local", "devices": 4})).raise_for_status()
        ids = []
        for _ in range(jobs):
            r = await client.post("/v1/jobs", json=JOB)
            r.raise_for_status()
            ids.append(r.json()["id"])
        _seed_trials(app.state.pipette.db.url, ids)  # type: ignore[attr-defined]
        paths = {"list": ["/v1/jobs?limit=20"], "job": [f"/v1/jobs/{i}" for i in ids],
                 "trials": [f"/v1/jobs/{i}/trials" for i in ids]}
        out: dict[str, float] = {}
        for kind, choices in paths.items():
            for n in range(20):  # warm: pools, caches, compiled statements
                (await client.get(choices[n % len(choices)])).raise_for_status()
            profiler = cProfile.Profile(time.process_time) if profile == kind else None
            start = time.process_time()
            if profiler:
                profiler.enable()
            for n in range(reads):
                r = await client.get(choices[n % len(choices)])
                if r.status_code != 200:
                    raise SystemExit(f"{r.status_code} {r.text}")
            if profiler:
                profiler.disable()
            out[kind] = 1000 * (time.process_time() - start) / reads
            if profiler:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(45)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--profile", choices=("list", "job", "trials"))
    args = parser.parse_args()

    from service.app import create_app
    from service.db import Database
    from service.settings import Settings

    with scratch_database("pipette_readcpu") as (_, url):
        headers = _token(url)
        db = Database(url)
        settings = Settings(database_url=url, home=Path(tempfile.mkdtemp(prefix="pipette-readcpu-")), scheduler=False,
                            max_queued_per_tenant=1000)
        app = create_app(settings, database=db)
        try:
            result = asyncio.run(_measure(app, headers, args.reads, args.jobs, args.profile))
        finally:
            db.dispose()
    print("CPU per read (ms, client included): " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
