"""The device presets added for issue 28: their data-sheet peaks, and the H100 family's curve for GH200."""

from __future__ import annotations

import pytest

from pipette.device import GB, DeviceSpec, GiB, MiB
from pipette.efficiency import family


@pytest.mark.parametrize(("name", "memory", "bf16", "bandwidth", "fam"), [
    ("B200-180GB", 183359 * MiB, 2250e12, 8.0e12, "b200"),  # nvidia-smi's total (issue 46)
    ("GH200-96GB", 96 * GB, 989e12, 4.0e12, "h100"),
    ("GH200-144GB", 144 * GB, 989e12, 4.9e12, "h100"),
    ("H200-141GB", 141 * GB, 989e12, 4.8e12, "h100"),
    ("A100-40GB", 40 * GiB, 312e12, 1.555e12, "a100"),
])
def test_presets_carry_the_data_sheet_peaks(name: str, memory: int, bf16: float, bandwidth: float, fam: str) -> None:
    d = DeviceSpec.preset(name.lower())
    assert (d.memory_bytes, d.peak("bf16"), d.memory_bandwidth, family(d)) == (memory, bf16, bandwidth, fam)
