"""A tenant's script that tries to read the service's secrets: every process's environment, the
files named in its arguments (Ray's token file, the service's database), every command line. It
prints what it could read, the secrets last (so a trial's kept output tail holds them), then a
summary, and fails before any step (so the service keeps its output)."""

import glob
import os
import sys

SECRETISH = ("PIPETTE_", "RAY_", "TOKEN", "SECRET", "DATABASE")
readable, denied, lines = [], [], []
for path in sorted(glob.glob("/proc/[0-9]*/environ")):
    try:
        data = open(path, "rb").read().decode(errors="replace").split("\0")
    except OSError:
        denied.append(path)
        continue
    readable.append(path)
    lines += [f"{path}: {v}" for v in data if any(s in v.split("=", 1)[0] for s in SECRETISH)]
files = {}
for path in sys.argv[1:]:
    try:
        files[path] = open(path, "rb").read(300).decode(errors="replace")
    except OSError as e:
        files[path] = f"denied ({type(e).__name__})"
print("\n".join(lines[-40:]))
for path, text in files.items():
    print(f"file {path}: {text}")
print(f"I am uid {os.getuid()}; environ readable: {len(readable)}, denied: {len(denied)}", flush=True)
raise SystemExit(f"spy done: uid {os.getuid()}")
