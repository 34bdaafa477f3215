"""The suite's units of parallel work (tests/conftest.py): a file each, the shaped-cluster tests
one unit together (two workers building it at once collided on its namespace names), the
end-to-end tests one unit (one session service and job), and every
test folder in the hand-out order."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FOLDER_ORDER, SHARED_UNITS, unit_of

TESTS = Path(__file__).resolve().parents[1]


def test_the_shaped_cluster_tests_are_one_unit_and_other_files_their_own() -> None:
    assert (
        unit_of("tests/cluster/test_shaped_cluster.py::test_a")
        == unit_of("tests/cluster/test_service_on_cluster.py::test_b[x]")
        == "tests/cluster"
    )
    assert (
        unit_of("tests/e2e/test_cli_e2e.py::test_a")
        == unit_of("tests/e2e/test_dashboard_e2e.py::test_b")
        == "tests/e2e"
    )  # one service and job, built once
    assert unit_of("tests/unit/test_docs.py::test_a") == "tests/unit/test_docs.py"
    assert unit_of("tests/unit/test_docs.py::test_a") != unit_of("tests/unit/test_sizes.py::test_a")
    assert unit_of("tests/service/test_service_api.py::test_x[postgresql]") == "tests/service/test_service_api.py"


def test_every_test_folder_has_its_place_in_the_order() -> None:
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders <= set(FOLDER_ORDER), folders - set(FOLDER_ORDER)
    assert set(SHARED_UNITS) <= folders
