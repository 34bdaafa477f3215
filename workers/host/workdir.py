"""A job's working directory, shipped to the nodes its script's ranks run on.

Ray ships a local directory only for a whole job (``ray.init(runtime_env=...)``), not per actor,
so the executor packs it (``pack``: a zip, without version-control, environment and cache
folders), puts it in Ray's object store once per trial, and each rank unpacks it into its own
folder (``unpack``) and runs there.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

from pipette.errors import SpecError

#: Folders never shipped: version control, virtual environments, caches.
SKIPPED = frozenset({".git", ".hg", ".venv", "venv", "__pycache__", "node_modules", ".mypy_cache",
                     ".pytest_cache", ".ruff_cache"})
#: The most a working directory may weigh (bytes) before it is refused.
MAX_BYTES = 256 * 1024**2


def pack(workdir: str | Path) -> bytes:
    root = Path(workdir)
    if not root.is_dir():
        raise SpecError(f"{str(root)!r} is not a folder", field="script.workdir",
                        fix="give the folder the script runs in")
    buffer = io.BytesIO()
    total = 0
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
            for name in sorted(names):
                path = Path(folder, name)
                if not path.is_file():
                    continue
                total += path.stat().st_size
                if total > MAX_BYTES:
                    raise SpecError(
                        f"{str(root)!r} holds more than {MAX_BYTES // 1024**2} MiB", field="script.workdir",
                        fix="give a working directory with the code only (read data from a path every node has)")
                info = zipfile.ZipInfo.from_file(path, str(path.relative_to(root)))
                with path.open("rb") as f:
                    archive.writestr(info, f.read(), zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def unpack(data: bytes, dest: str | Path) -> str:
    """Unpack ``pack``'s zip into ``dest`` (modes kept, so executables stay executable)."""
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            target = (out / info.filename).resolve()
            if not str(target).startswith(str(out.resolve()) + os.sep):
                raise ValueError(f"unsafe path in the working directory's archive: {info.filename}")
            archive.extract(info, out)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(target, mode & 0o777)
    return str(out)
