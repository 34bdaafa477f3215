"""Integration fixtures: one real local Ray for the session, DeepSpeed on CPU with gloo."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("ray")


@pytest.fixture(scope="session", autouse=True)
def ray_session() -> Iterator[None]:
    import ray

    from workers.host.ray_cluster import ensure_ray
    from workers.ops import build_ops

    # DeepSpeed builds its CPU shared-memory comm op on first use (about a minute, once per
    # machine, cached); build it here so no trial's timeout pays for it, into the cache the ranks
    # use, as a job does (workers.ops): a lock a killed build left behind is removed, where
    # DeepSpeed's own build_shm_op waited on it for ever.
    build_ops("cpu", timeout_s=600)
    ensure_ray()
    yield
    ray.shutdown()
