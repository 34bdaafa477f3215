"""``./dev``: the first run says what it installs; ``./dev test`` installs Debian packages
(chromium, for the browser tests) only in CI or when asked, else prints the command and stops
before installing anything (issue 32, item 3). Run for real, with stand-ins for ``python3`` and
``apt-get`` that record their calls and fail, so nothing is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("chromium") is not None, reason="chromium is installed here")


def _dev(tmp: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    calls = tmp / "calls"
    for name in ("python3", "apt-get"):
        (fake / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        (fake / name).chmod(0o755)
    done = subprocess.run([str(ROOT / "dev"), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp),
                               "PIPETTE_VENV": str(tmp / "venv"), **env})
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_dev_test_prints_the_apt_command_and_installs_nothing(tmp_path: Path) -> None:
    done, calls = _dev(tmp_path, "test")
    assert done.returncode == 1
    assert "apt-get install -y chromium" in done.stderr
    assert "./dev test --install-system" in done.stderr
    assert calls == []  # neither apt-get nor the venv's install ran


def test_in_ci_or_when_asked_it_installs_chromium(tmp_path: Path) -> None:
    for args, env in ((("test",), {"CI": "true"}), (("test", "--install-system"), {}),
                      (("test",), {"PIPETTE_INSTALL_SYSTEM": "1"})):
        done, calls = _dev(tmp_path, *args, **env)
        assert done.returncode == 1 and "installing chromium" in done.stderr, done.stderr
        assert calls and calls[0].startswith("apt-get update"), calls
        (tmp_path / "calls").unlink()


def test_tests_that_need_no_browser_need_no_chromium_and_the_first_install_says_what_it_does(
        tmp_path: Path) -> None:
    done, calls = _dev(tmp_path, "test", "tests/unit/test_cli.py")
    assert "chromium" not in done.stderr
    assert calls[0] == f"python3 -m venv {tmp_path / 'venv'}"  # went on to install
    assert "first run: creating" in done.stderr and "torch 2.13.0" in done.stderr
    assert "a few minutes" in done.stderr
