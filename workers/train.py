"""``python -m workers.train``: the runner's entry under its old name, for launch files emitted
before it moved to ``workers.rank.train`` (``pipette.contract.OLD_TRAIN_ENTRY``); to be
removed in the release after next."""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("workers.rank.train", run_name="__main__", alter_sys=True)
