"""fits_boundary.py's table per set and stack (issue 46): a run that ran is dropped by a chance to fit under
the keep threshold or by a rule of the plan; an out-of-memory run is called likely to fit at >= 50%."""

from __future__ import annotations

import math

from pipette.fits import FitsPrior
from tests.benchmarks.calibration import calibration_dir, load_megatron_bridge
from tests.benchmarks.fits_boundary import Point, rule_breaks, table_line

PRIOR = FitsPrior("test", mu=0.0, sd=0.1, source="test")


def test_a_line_counts_drops_by_chance_and_by_rule_once_each_and_ooms_called_likely() -> None:
    ran = [
        Point("roomy", math.log(1.5), 0.0),
        Point("tight", math.log(0.7), 0.0),
        Point("refused rule: interleaved_layers", math.log(0.7), 0.0),
        Point("fine rule: pp_layers", 1.0, 0.0),
    ]
    failed = [Point("oom called", math.log(1.2), None), Point("oom seen", math.log(0.9), None)]
    line, missed = table_line("set", "megatron", PRIOR, ran, failed)
    assert "| 4 | 3 (75.0%): 2 / 2 | 2 | 1 (50.0%) |" in line and missed
    line, missed = table_line("set", "megatron", PRIOR, ran[:1] * 60, [])
    assert "| 60 | 0 (0.0%): 0 / 0 | - | - |" in line and not missed


def test_the_405b_runs_pass_the_rules_with_the_embedding_and_loss_as_layers() -> None:
    rows = [r for r in load_megatron_bridge(calibration_dir(), cp=True).rows if r.model.layers == 126]
    assert rows and all(rule_breaks(r) == [] for r in rows)
    assert any(r.config.virtual_stages > 1 and 126 % (r.config.pp * r.config.virtual_stages) for r in rows)
