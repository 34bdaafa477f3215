"""Starting the embedded Ray prints nothing a user cannot act on: Ray's "Token authentication is
enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out" came at every tune, while
the token is what Pipette wants (issue 43 item 24), and so did "Started a local Ray instance." The
token stays on; Ray's other messages pass.
A fresh interpreter, as a tune is: a Ray started by another test would hide a first start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)

DRIVER = r"""
import logging
from workers.host.ray_cluster import ensure_ray, stop_local_ray
from ray._private.authentication.authentication_utils import is_token_auth_enabled

ensure_ray(num_cpus=2)
print("TOKEN", is_token_auth_enabled(), flush=True)
# only the start is quieted: the same logger still speaks afterwards
logging.getLogger("ray._private.authentication.authentication_token_setup").warning("after-start")
logging.getLogger("ray._private.worker").warning("worker-after-start")
stop_local_ray()
"""


def test_the_embedded_ray_starts_without_its_notices_and_keeps_its_token() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True,
                          timeout=200, cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "TOKEN True" in out
    assert "Token authentication is enabled" not in out, out[-3000:]
    assert "Started a local Ray instance" not in out, out[-3000:]
    assert "after-start" in out and "worker-after-start" in out
