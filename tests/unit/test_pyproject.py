"""Installing Pipette prints no deprecation a user cannot act on: setuptools warned three times
per ``pip install -e .`` that ``project.license`` as a TOML table is deprecated (issue 43 item
24). Read the real pyproject.toml with the installed setuptools, warnings as errors."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

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
