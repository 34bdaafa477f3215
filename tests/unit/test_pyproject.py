"""Installing Pipette prints no deprecation a user cannot act on: setuptools warned three times
per ``pip install -e .`` that ``project.license`` as a TOML table is deprecated (issue 43 item
24). Read the real pyproject.toml with the installed setuptools, warnings as errors."""

from __future__ import annotations

import os
import shlex
import subprocess
import tomllib
import venv
import warnings
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parents[2]


def test_setuptools_reads_pyproject_without_a_deprecation() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecation (SetuptoolsDeprecationWarning is a Warning) fails
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"


def test_the_build_requires_a_setuptools_that_reads_an_spdx_license() -> None:
    # setuptools 77 is the first to take `license = "SPDX"` (PEP 639)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert "setuptools>=77" in requires


@pytest.mark.slow
def test_the_dev_install_of_pipette_prints_no_setuptools_notice(tmp_path: Path) -> None:
    """setuptools' "Editable installation ... Please be careful with folders in your working
    directory with the same name as your package" came at every ``./dev`` install (issue 43 item
    24's kind of noise): run ``./dev``'s own install line (its environment, into a throwaway venv)."""
    line = next(ln for ln in (ROOT / "dev").read_text().splitlines() if "pip install --quiet -e" in ln)
    env = dict(os.environ)
    for word in shlex.split(line.split('"$PY"')[0]):
        name, _, value = word.partition("=")
        env[name] = value
    # a venv of its own: pip installing elsewhere (--prefix) still uninstalls the suite's own
    # editable Pipette first, and every later test that starts `python -m cli` lost it
    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    # dev's first step: the pip that shows a build backend's warnings (Python's bundled pip does not)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True, capture_output=True,
                   timeout=600)
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps",
                           "-e", str(ROOT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Editable installation" not in done.stdout + done.stderr, done.stderr[-3000:]
