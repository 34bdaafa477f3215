"""The zygote's preload covers what a rank imports in ``deepspeed.initialize``.

A CPU rank forks from the node's zygote (``workers.host.zygote``), which imported ``PRELOAD`` once;
whatever a rank imports after the fork it imports in every rank of every trial. DeepSpeed
0.19 imports its Muon optimizer inside ``deepspeed.initialize``, and that module runs
``torch.compile`` at import (TorchInductor: 3.2 of a rank's 3.6 s in ``deepspeed.initialize``
on the 2-core machine). This runs a real ``deepspeed.initialize`` (ZeRO 1, gloo, one process)
after the preload, in the zygote's import environment, and lists what it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.host.zygote import IMPORT_ENV, PRELOAD

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]

RANK = """
import importlib, json, os, socket, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
before = set(sys.modules)
import torch, deepspeed
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(8, 8)
config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
engine.backward(engine(torch.ones(2, 8)).sum()); engine.step()
print("@@new " + json.dumps(sorted(set(sys.modules) - before)))
"""


def test_deepspeed_initialize_imports_nothing_heavy_after_the_preload(tmp_path: Path) -> None:
    env = {**os.environ, **IMPORT_ENV, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", RANK, json.dumps(PRELOAD)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("@@new ")]
    new = json.loads(line.removeprefix("@@new "))
    heavy = [m for m in new if m.split(".")[:2] in (["torch", "_inductor"], ["torch", "_dynamo"])]
    assert not heavy, f"every rank imports these after the fork; add their importer to PRELOAD: {heavy[:10]}"
    assert len(new) < 150, f"{len(new)} modules imported after the preload: {new[:40]}"
