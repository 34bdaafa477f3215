"""Which tests may run at the same time, and in what order the suite hands them out.

``./dev test`` runs the suite on two pytest-xdist workers. Each test file is one unit of work
(its module and session fixtures, e.g. a local Ray or a served API, are built once in one worker,
and its tests keep their order). The multi-host tests of ``tests/cluster`` are one unit together:
they share one shaped cluster whose network namespaces and Ray ports have fixed names, so two
workers must never build it at once. The end-to-end tests of ``tests/e2e`` are one unit too: their
session's service, profile, browser and finished job (``tests/e2e/conftest.py``) are built once, not
once per worker. The units go out slowest folder first (``FOLDER_ORDER``), so
the last ones to finish are short unit-test files rather than a tune that started late.

The shaped cluster's unit runs with the machine to itself (``SOLO_UNITS``, ``tests/machine_lock.py``):
its service test judges the tuner's pick by step times, which a test on the other worker can
reorder on two cores (``tests/machine_lock.py``: what CI showed). The other worker waits meanwhile,
the length of the cluster unit (about 6 minutes in the 2026-12-05 suite runs). So does the Accelerate
FSDP example's file (about 40 s alone): it compares its launch's step time with its trial's only on a
quiet machine, and beside the other worker it never was (skipped in both suite runs before this on 2026-12-05).

xdist's own ``--dist loadgroup`` does not group under pytest 9.2 (it renames ``item._nodeid``,
which pytest no longer reads), so the grouping is a scheduler of this suite
(``pytest_xdist_make_scheduler``): xdist's load-scope scheduling with this file's scope rule.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.machine_lock import MachineLock

_TESTS = Path(__file__).resolve().parent
#: test folders whose files must all run in one worker (they share a machine-wide resource, or
#: an expensive session fixture that each worker would otherwise build again)
SHARED_UNITS = {"cluster": "tests/cluster", "e2e": "tests/e2e"}
#: units that hold the machine alone while they run (their assertions compare step times)
SOLO_UNITS = {"tests/cluster", "tests/integration/test_accelerate_fsdp_script.py"}
#: folders, slowest first (a full run's time per folder on the 2-core VM: integration about 60%)
FOLDER_ORDER = ("cluster", "integration", "e2e", "fsdp", "service", "unit", "deploy", "gpu")


def unit_of(nodeid: str) -> str:
    """The unit of work of a test id (``tests/unit/test_x.py::test_y``): its folder's shared unit,
    else its file."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return SHARED_UNITS.get(folder, path)


def _order(item: pytest.Item) -> tuple[int, str]:
    relative = item.path.resolve().relative_to(_TESTS)
    folder = relative.parts[0] if len(relative.parts) > 1 else ""
    rank = FOLDER_ORDER.index(folder) if folder in FOLDER_ORDER else len(FOLDER_ORDER)
    return rank, relative.as_posix()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: the tests of a file keep their order; every worker collects the same order
    items.sort(key=_order)


_LOCK = pytest.StashKey[MachineLock]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Under xdist, a test of a solo unit holds the machine alone from its unit's first setup to
    its last teardown; any other test holds it shared for its own setup, call and teardown."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:  # one process: nothing runs beside it
        return (yield)
    lock = item.config.stash.get(_LOCK, None)
    if lock is None:
        lock = item.config.stash[_LOCK] = MachineLock(str(workerinput["testrunuid"]))
    solo = unit_of(item.nodeid) in SOLO_UNITS
    if solo:
        lock.own()
    else:
        lock.share()
    try:
        return (yield)
    finally:
        if not solo or nextitem is None or unit_of(nextitem.nodeid) != unit_of(item.nodeid):
            lock.release()


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        from xdist.scheduler import LoadScopeScheduling

        class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
            def _split_scope(self, nodeid: str) -> str:
                return unit_of(nodeid)

        config.option.loadscopereorder = False  # the collection's order (slowest folders first)
        return UnitScheduling(config, log)
