"""A job's working directory, shipped to the nodes its script's ranks run on.

Ray ships a local directory only for a whole job (``ray.init(runtime_env=...)``), not per actor,
so the executor packs it (``pack``: a zip, without version-control, environment and cache
folders), puts it in Ray's object store once per trial, and each rank unpacks it into its own
folder (``unpack``) and runs there.
"""

from __future__ import annotations

import io
import os
import shutil
import zipfile
import zlib
from pathlib import Path

from pipette.errors import SpecError

#: Folders never shipped: version control, virtual environments, caches.
SKIPPED = frozenset({".git", ".hg", ".venv", "venv", "__pycache__", "node_modules", ".mypy_cache",
                     ".pytest_cache", ".ruff_cache"})
#: The most a working directory may weigh (bytes) before it is refused.
MAX_BYTES = 256 * 1024**2
#: The most files a working directory may hold.
MAX_MEMBERS = 10_000
#: The most a file may be compressed (uncompressed to compressed size), for files over
#: ``RATIO_FLOOR`` bytes: deflate reaches ~1000:1 on zeros, code and text 3-20:1.
MAX_RATIO = 200
RATIO_FLOOR = 1024**2
#: Bytes unpacked at a time (counted against ``MAX_BYTES`` as they are written).
CHUNK = 1024**2


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


def check_archive(archive: zipfile.ZipFile, field: str = "script.files") -> None:
    """Refuse, before a byte is unpacked, an archive that would unpack to too much (the sizes its
    directory declares), holds too many files, compresses implausibly well (a zip bomb) or names
    a path outside its folder. Declared sizes can lie: ``unpack`` counts the bytes it writes too."""
    members = archive.infolist()
    if len(members) > MAX_MEMBERS:
        raise SpecError(f"holds {len(members)} files, more than the limit of {MAX_MEMBERS}", field=field,
                        fix="send the working directory with the code only (read data from a path every node has)")
    declared = sum(m.file_size for m in members)
    if declared > MAX_BYTES:
        raise SpecError(f"unpacks to {declared / 1024**2:.0f} MiB, more than the limit of "
                        f"{MAX_BYTES // 1024**2} MiB", field=field,
                        fix="send the working directory with the code only (read data from a path every node has)")
    for m in members:
        if m.file_size > RATIO_FLOOR and m.file_size > MAX_RATIO * max(m.compress_size, 1):
            raise SpecError(f"holds {m.filename!r}, compressed {m.file_size // max(m.compress_size, 1)} to 1, "
                            f"more than the limit of {MAX_RATIO} to 1 (a zip bomb?)", field=field,
                            fix="send the working directory as pipette submit packs it, without generated data")
        if _unsafe(m.filename):
            raise SpecError(f"holds {m.filename!r}, a path outside the working directory", field=field,
                            fix="send paths relative to the working directory, without .. or a leading /")


def _unsafe(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or (len(name) > 1 and name[1] == ":")


def unpack(data: bytes, dest: str | Path, max_bytes: int = MAX_BYTES) -> str:
    """Unpack ``pack``'s zip into ``dest`` (modes kept, so executables stay executable). The
    archive is checked first (``check_archive``) and the bytes written are counted: past
    ``max_bytes``, or on a broken archive, ``dest`` is removed and a ``SpecError`` says why."""
    out = Path(dest)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            check_archive(archive, "script.workdir")
            out.mkdir(parents=True, exist_ok=True)
            written = 0
            for info in archive.infolist():
                written = _extract(archive, info, out, written, max_bytes)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        shutil.rmtree(out, ignore_errors=True)
        raise SpecError(f"is not a readable zip ({e})", field="script.workdir",
                        fix="send the working directory as pipette submit packs it (zip, base64)") from None
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return str(out)


def _extract(archive: zipfile.ZipFile, info: zipfile.ZipInfo, out: Path, written: int, max_bytes: int) -> int:
    """Write one member under ``out``; the bytes written so far, this member's included."""
    target = (out / info.filename).resolve()
    if not str(target).startswith(str(out.resolve()) + os.sep):
        raise SpecError(f"holds {info.filename!r}, a path outside the working directory", field="script.workdir",
                        fix="send paths relative to the working directory, without .. or a leading /")
    if info.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        return written
    target.parent.mkdir(parents=True, exist_ok=True)
    with archive.open(info) as src, target.open("wb") as dst:
        while chunk := src.read(CHUNK):
            written += len(chunk)
            if written > max_bytes:
                raise SpecError(f"unpacks to more than {max_bytes // 1024**2} MiB (its sizes said "
                                f"{sum(m.file_size for m in archive.infolist()) / 1024**2:.0f} MiB)",
                                field="script.workdir",
                                fix="send the working directory with the code only (read data from a path "
                                    "every node has)")
            dst.write(chunk)
    mode = info.external_attr >> 16
    if mode:
        os.chmod(target, mode & 0o777)
    return written
