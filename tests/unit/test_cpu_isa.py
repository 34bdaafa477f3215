"""``workers.cpu_isa``: the AMX probe runs once per node, not once per rank actor and trial."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers import cpu_isa


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A node whose CPU advertises AMX, with its own temp folder and no answer yet."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cpu_isa, "_advertises_amx", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    cpu_isa.cpu_isa_env.cache_clear()
    yield tmp_path
    cpu_isa.cpu_isa_env.cache_clear()


def test_the_real_probe_runs_once_and_a_new_process_reads_its_answer(
        node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = cpu_isa.cpu_isa_env()  # the real probe: a bf16 matmul in a child process
    assert first in ({}, {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA})
    assert cpu_isa.cache_path().parent == node / f"pipette-{os.getuid()}" and cpu_isa.cache_path().exists()

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("probed again: the node's answer was not read")

    monkeypatch.setattr(cpu_isa.subprocess, "run", no_probe)
    cpu_isa.cpu_isa_env.cache_clear()  # as a fresh rank actor starts with an empty cache
    assert cpu_isa.cpu_isa_env() == first


def test_rank_actors_starting_together_probe_once(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def slow_probe() -> dict[str, str]:
        calls.append(1)
        time.sleep(0.3)  # the others ask while it runs: they must wait for its answer
        return {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA}

    monkeypatch.setattr(cpu_isa, "_probe", slow_probe)
    answers: list[dict[str, str]] = []
    threads = [threading.Thread(target=lambda: answers.append(cpu_isa.cpu_isa_env.__wrapped__())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert answers == [{"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA}] * 4


@pytest.mark.parametrize("torn", ["", "{not json", '{"env": ["ONEDNN_MAX_CPU_ISA"]}', '{"env": {"A": 1}}', "[]"])
def test_an_unreadable_answer_is_probed_again_and_replaced(
        node: Path, monkeypatch: pytest.MonkeyPatch, torn: str) -> None:
    cpu_isa.cache_path().write_text(torn)
    monkeypatch.setattr(cpu_isa, "_probe", lambda: {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA})
    assert cpu_isa.cpu_isa_env() == {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA}
    cpu_isa.cpu_isa_env.cache_clear()
    monkeypatch.setattr(cpu_isa, "_probe", lambda: pytest.fail("the replaced answer was not read"))
    assert cpu_isa.cpu_isa_env() == {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA}


def test_the_answer_belongs_to_one_boot_python_and_torch(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "_probe", lambda: {})
    assert cpu_isa.cpu_isa_env() == {}
    cpu_isa.cpu_isa_env.cache_clear()
    monkeypatch.setattr(cpu_isa.sys, "executable", "/another/venv/bin/python")
    monkeypatch.setattr(cpu_isa, "_probe", lambda: {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA})
    assert cpu_isa.cpu_isa_env() == {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA}  # not the other Python's answer
    assert len(list(node.glob("pipette-*/cpu-isa-*.json"))) == 2


def test_no_probe_where_amx_is_not_advertised_or_the_isa_is_set(
        node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "_probe", lambda: pytest.fail("probed"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_isa.cpu_isa_env() == {}
    cpu_isa.cpu_isa_env.cache_clear()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(cpu_isa, "_advertises_amx", lambda: False)
    assert cpu_isa.cpu_isa_env() == {}
    assert not list(node.glob("pipette-*/cpu-isa-*"))


def test_an_unwritable_temp_folder_still_answers(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(node / "missing" / "folder"))
    monkeypatch.setattr(cpu_isa, "_probe", lambda: {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA})
    assert cpu_isa.cpu_isa_env() == {"ONEDNN_MAX_CPU_ISA": cpu_isa.SAFE_ISA}
