"""The phases a trial's caller hears: every phase the slowest rank enters, in order, even when
its ranks pass through several between two polls (a short trial on a fast machine)."""
from __future__ import annotations

from workers.host.monitor import PHASE_TICK_S, RankPhases
from workers.phases import ORDER


def _told(world: int, events: list[tuple[int, str]]) -> list[str]:
    heard: list[str] = []
    phases = RankPhases(world, lambda phase, elapsed: heard.append(phase))
    phases.tick(0.0)  # the first poll, nothing heard yet
    for rank, phase in events:  # all read within one poll, rank by rank as the monitor reads them
        phases.enter(rank, phase, 0.1)
    phases.tick(0.2)
    return heard


def test_phases_passed_within_one_poll_are_each_told_once_in_order() -> None:
    walk = ["ops", "build", "warmup", "steps", "end"]
    heard = _told(2, [(0, p) for p in walk] + [(1, p) for p in walk])
    assert heard == ["start", *walk]
    assert [ORDER.index(p) for p in heard] == sorted(ORDER.index(p) for p in heard)


def test_the_rank_behind_sets_the_phase() -> None:
    heard = _told(2, [(0, "ops"), (1, "ops"), (0, "steps"), (0, "end")])
    assert heard == ["start", "ops"]


def test_a_phase_that_stays_is_told_again_after_the_tick() -> None:
    heard: list[str] = []
    phases = RankPhases(1, lambda phase, elapsed: heard.append(f"{phase}@{elapsed:.0f}"))
    phases.enter(0, "build", 1.0)
    phases.tick(1.0 + PHASE_TICK_S / 2)
    phases.tick(1000.0)
    assert heard == ["build@1", "build@1000"]
