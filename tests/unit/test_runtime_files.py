"""Runtime files of a node (issue 32, item 11): the zygote's socket, pid, lock and log live in
a private per-user folder; nothing planted there is signalled or opened through a link.

Before the fix they lay in the shared temp folder: a pid written into ``.sock.pid`` was
SIGKILLed by the next trial that found no live zygote, and a symlink planted as ``.lock`` had
its target truncated."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipette.errors import PipetteError
from workers.host import zygote
from workers.runtime import read_private, runtime_dir, write_private


@pytest.fixture
def tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A node whose temp folder is ``tmp_path`` (as ``TMPDIR`` would make it)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path


@pytest.fixture
def planted() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this user that is not a zygote (what a stale pid file may name)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_socket_lives_in_a_private_folder(tmp: Path) -> None:
    path = Path(zygote.socket_path({}))
    info = os.lstat(path.parent)
    assert path.parent.parent == tmp and path.parent.name == f"pipette-{os.getuid()}"
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700


def test_a_planted_pid_is_not_signalled(tmp: Path, planted: subprocess.Popen[bytes]) -> None:
    path = zygote.socket_path({})
    Path(path + ".pid").write_text(str(planted.pid))
    zygote._kill_stale(path)
    time.sleep(0.2)
    assert planted.poll() is None, "a process that is not our zygote was killed"
    assert not os.path.exists(path + ".pid")


def _fake_zygote(tmp_path: Path, path: str) -> subprocess.Popen[bytes]:
    """A process that is ``python -m workers.host.zygote PATH`` (it only sleeps), its pid in PATH.pid."""
    fake = tmp_path / "fake"
    if not fake.exists():
        (fake / "workers" / "host").mkdir(parents=True)
        (fake / "workers" / "__init__.py").write_text("")
        (fake / "workers" / "host" / "__init__.py").write_text("")
        (fake / "workers" / "host" / "zygote.py").write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "workers.host.zygote", path], cwd=fake)
    Path(path + ".pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 10  # /proc/PID/cmdline reads empty for a moment after the exec
    while not Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_a_stale_zygote_of_the_socket_is_still_removed(tmp: Path, tmp_path: Path) -> None:
    """A process that is ``python -m workers.host.zygote PATH`` for this socket is ours: killed."""
    path = zygote.socket_path({})
    proc = _fake_zygote(tmp_path, path)
    try:
        assert zygote.is_our_zygote(proc.pid, path)
        assert not zygote.is_our_zygote(proc.pid, path + "x")  # another socket's zygote is not this one's
        zygote._kill_stale(path)
        assert proc.wait(10) == -9
    finally:
        proc.kill()
        proc.wait()


def test_the_files_of_ended_servers_are_swept(tmp: Path, tmp_path: Path,
                                             planted: subprocess.Popen[bytes]) -> None:
    """A stopped Ray SIGKILLs its zygote, and the names are per Ray node: each local Ray left a
    socket, a pid file and an empty log. The next server start removes the sets whose pid names no
    zygote of their socket; a live one's files, a failure's log and the planted process stay."""
    folder = runtime_dir()
    ended = subprocess.Popen(["true"])
    ended.wait()

    def plant(name: str, pid: int, err: str = "") -> str:
        path = str(folder / f"zygote-{name}.sock")
        for suffix, text in (("", ""), (".pid", str(pid)), (".err", err)):
            Path(path + suffix).write_text(text)
        return path

    plant("aaaaaaaaaaaa-node1", ended.pid)
    failed = plant("aaaaaaaaaaaa-node2", ended.pid, err="Traceback: the server failed\n")
    plant("aaaaaaaaaaaa-node3", planted.pid)
    live_path = str(folder / "zygote-aaaaaaaaaaaa-node4.sock")
    live = _fake_zygote(tmp_path, live_path)
    Path(live_path).write_text("")
    try:
        zygote._sweep_ended(folder)
        left = sorted(p.name for p in folder.iterdir())
        assert left == sorted([Path(failed).name + ".err", Path(live_path).name, Path(live_path).name + ".pid"]), left
        assert planted.poll() is None and live.poll() is None, "the sweep signalled a process"
    finally:
        live.kill()
        live.wait()


def test_a_planted_lock_link_is_not_opened_through(tmp: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = zygote.socket_path({})
    os.symlink(victim, zygote.lock_path({}))
    with pytest.raises(PipetteError, match="symbolic link"):
        zygote._start_server(path, {})
    assert victim.read_text() == "precious\n"


def test_no_runtime_file_is_opened_through_a_link(tmp: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("zygote.err", "zygote.pid", "cpu-isa.json"):
        link = runtime_dir() / name
        link.symlink_to(victim)
        with pytest.raises(PipetteError, match=f"{link} is a symbolic link"):
            write_private(link, "planted")
        with pytest.raises(PipetteError, match="symbolic link"):
            read_private(link)
    assert victim.read_text() == "precious\n"


def test_a_runtime_folder_of_another_user_is_refused(tmp: Path) -> None:
    folder = tmp / f"pipette-{os.getuid()}"
    folder.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(folder, 65534, 65534)
        with pytest.raises(PipetteError, match="belongs to uid 65534"):
            runtime_dir()
    folder.rmdir()
    folder.symlink_to(tmp)
    with pytest.raises(PipetteError, match="not a folder"):
        runtime_dir()


def test_a_loose_folder_of_ours_is_closed(tmp: Path) -> None:
    folder = tmp / f"pipette-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    assert runtime_dir() == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
