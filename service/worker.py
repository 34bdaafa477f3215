"""``python -m service.worker``: ``pipette-admin worker``, a scheduler process without the API
(``service.scheduler.run_worker``).

Run one per set of devices (one per Ray cluster, with its ``RAY_ADDRESS``), or several for
the same devices: the lease lets one of them run trials at a time and another takes over
when it dies. SIGTERM or Ctrl-C stops it gracefully (the running trial is rerun on resume).
"""

from __future__ import annotations

import sys

from service.admin import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(["worker", *sys.argv[1:]]))
