"""Integration fixtures: one real local Ray for the session, DeepSpeed on CPU with gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("ray")


@pytest.fixture(scope="session", autouse=True)
def ray_session() -> Iterator[None]:
    import ray

    from workers.host.ray_cluster import ensure_ray
    from workers.rank.train import build_environment

    # DeepSpeed builds its CPU shared-memory comm op on first use (about a minute, once per
    # machine, cached); build it here so no trial's timeout pays for it, with the ninja and
    # into the cache the ranks use (workers.rank.train.build_environment).
    subprocess.run(
        [sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
        env={**os.environ, "DS_ACCELERATOR": "cpu", **build_environment()},
        check=True, capture_output=True, timeout=600,
    )
    ensure_ray()
    yield
    ray.shutdown()
