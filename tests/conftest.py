"""Suite-wide collection rule: the groups that may run at the same time.

``./dev test`` runs the suite on two pytest-xdist workers with ``--dist loadgroup``. Each test
file is one group (its module and session fixtures, e.g. a local Ray or a served API, are built
once in one worker, and its tests keep their order). The multi-host tests of ``tests/cluster`` are
one group together: they share one shaped cluster whose network namespaces and Ray ports have
fixed names, so two workers must never build it at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
#: test folders whose files must all run in one worker (they share a machine-wide resource)
SHARED_GROUPS = {"cluster": "shaped-cluster"}


def group_of(path: Path) -> str:
    """The xdist group of a test file: its folder's shared group, else the file itself."""
    relative = path.resolve().relative_to(_TESTS)
    return SHARED_GROUPS.get(relative.parts[0], relative.as_posix())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(m.name == "xdist_group" for m in item.iter_markers()):
            item.add_marker(pytest.mark.xdist_group(group_of(item.path)))
