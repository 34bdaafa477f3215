"""Writes its environment as JSON to the file named by its argument (the credentials test)."""
import json
import os
import sys

with open(sys.argv[1], "w") as f:
    json.dump(dict(os.environ), f)
