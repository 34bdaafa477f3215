"""Fails when its environment holds a credential of the service that started it, else runs the
script named by its first argument with the rest (the service's script-job test)."""

import os
import runpy
import sys

SERVICE_ONLY = ("PIPETTE_DATABASE_URL", "PIPETTE_METRICS_TOKEN", "PIPETTE_HOME", "PIPETTE_TEST_SECRET")
leaked = sorted(k for k in os.environ if k in SERVICE_ONLY or "TOKEN" in k or "SECRET" in k)
if leaked:
    raise RuntimeError(f"the script's environment holds {leaked}")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
