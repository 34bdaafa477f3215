"""``python -m service``: serve the API (``pipette-admin serve``)."""

from __future__ import annotations

import sys

from service.admin import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(["serve", *sys.argv[1:]]))
