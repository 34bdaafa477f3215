"""How long the probe of a 4-device CPU cluster takes on this machine (target: <= 60 s).

    ./dev bench probe_speed
"""

from __future__ import annotations

import time

from pipette.model import ModelSpec
from workers.host.probe import probe_cluster


def main() -> None:
    start = time.monotonic()
    profile = probe_cluster(cpu_devices_per_node=4, model=ModelSpec.preset("tiny-llama"))
    total = time.monotonic() - start
    print(f"probe of {profile.world} CPU devices: {total:.1f} s (Ray start included; probe itself "
          f"{profile.extra['probe_s']:.1f} s)")
    print(f"bandwidth GB/s:\n{(profile.bandwidth / 1e9).round(2)}")
    print(f"latency us:\n{(profile.latency * 1e6).round(1)}")


if __name__ == "__main__":
    main()
