import sys

from pipette.cli import main

sys.exit(main())
