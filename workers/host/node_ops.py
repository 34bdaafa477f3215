"""DeepSpeed's CPU op on every node of a cluster, built once before a job's first trial
(``workers.ops``): one Ray task per node, pinned there, none of it on a trial's clock."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from workers.ops import WHAT, OpsBuildError, build_ops, extensions_dir, ops_built


@ray.remote(num_cpus=0, max_retries=0)
def _built(env: dict[str, str]) -> bool:
    cache = env.get("TORCH_EXTENSIONS_DIR")
    return ops_built(Path(cache) if cache else extensions_dir())


@ray.remote(num_cpus=0, max_retries=0)
def _build(env: dict[str, str]) -> dict[str, Any]:
    try:
        return build_ops("cpu", env)
    except OpsBuildError as e:  # said by the driver: a task's exception arrives wrapped
        return {"error": e.message, "fix": e.fix}


#: how often a running build asks whether its job must stop (seconds)
STOP_POLL_S = 0.5
#: how long a cancelled build gets to end its processes (seconds)
CANCEL_WAIT_S = 10.0


def _on(ip: str) -> dict[str, Any]:
    return {"resources": {f"node:{ip}": 0.001}}


def build_on_nodes(ips: list[str], env: dict[str, str], note: Callable[[str], None],
                   force: bool = False, should_stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
    """Build the op on every node at ``ips`` where it is not built (``force``: load it on every
    node, which rebuilds it where PyTorch finds it stale), in the ranks' environment ``env``
    (its TORCH_EXTENSIONS_DIR); says when it builds and how long it took. Raises
    ``OpsBuildError`` naming the node where it failed. ``should_stop`` is asked while the builds
    run: True cancels them (their processes end) and returns None within seconds."""
    built = ray.get([_built.options(**_on(ip)).remote(env) for ip in ips], timeout=120)
    missing = [ip for ip, ok in zip(ips, built, strict=True) if not ok]
    if not missing and not force:
        return {"nodes": len(ips), "built": 0, "seconds": 0.0}
    if missing:
        note(f"building {WHAT} on {', '.join(missing)}: once per environment, before the first trial and "
             "outside its timeout (half a minute to a few minutes) ...")
    results = _wait_all([_build.options(**_on(ip)).remote(env) for ip in (ips if force else missing)], should_stop)
    if results is None:
        note(f"stopped building {WHAT}: the job was told to stop")
        return None
    for ip, r in zip(ips if force else missing, results, strict=True):
        if "error" in r:
            raise OpsBuildError(f"on {ip}: {r['error']}", field="environment", fix=r["fix"])
    compiled = [r for r in results if r.get("built")]
    if compiled:
        note(f"built {WHAT} in {max(float(r['wall_s']) for r in compiled):.0f} s (cached in {compiled[0]['cache']})")
    return {"nodes": len(ips), "built": len(compiled), "seconds": max(float(r["wall_s"]) for r in results)}


def _wait_all(refs: list[Any], should_stop: Callable[[], bool] | None) -> list[Any] | None:
    """``ray.get(refs)``, asking ``should_stop`` every ``STOP_POLL_S``: a build takes minutes,
    and a cancelled job waited for it (issue 43, item 8). None when told to stop."""
    pending = list(refs)
    try:
        while pending:
            if should_stop is not None and should_stop():
                _cancel(pending)
                return None
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=STOP_POLL_S)
    except BaseException:  # Ctrl-C of the CLI, a shutdown: no build goes on unwatched
        _cancel(pending)
        raise
    return list(ray.get(refs))


def _cancel(refs: list[Any]) -> None:
    """Cancel running builds: the task gets a KeyboardInterrupt, and ``build_ops`` ends its
    build's whole session on the way out. Waits (briefly) for that to be done."""
    for ref in refs:
        ray.cancel(ref)
    ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)
