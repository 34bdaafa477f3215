"""The retry policy: whether a trial's failed attempt runs again (``RetryPolicy.after``), and when.

A trial that fails for another reason than memory (``failed``, ``timeout``) is retried
``retries`` times at most, then recorded as failed; the search goes on. A retry is never run at
once: the crash is recorded with a ``RETRY_LATER`` note, and its candidate is tried again, as a
trial of its own (purpose ``"retry"``), once a trial of another candidate has run (or nothing else
is left to try), and only while it is still predicted faster than the best measured then
(``deferred``; the tuner asks). A crash retried at once took the first trials of a job: on the
Ultra-Scale replay a user who stopped after two trials had one crashed layout, tried twice.
A crash is retried only while this job's retries of its kind (``crash_kind``: the status and the
error's exception line) ran at least as often as they crashed again (``retry_chance``): the
first retry of a kind that crashes again makes it the candidate's own failure, not the machine's
(in the replay every crash is the candidate's: Ultra-Scale's pipeline-16 runs). A failure of the
user's script, or a candidate the script says it cannot run, is never retried: a retry repeats
it. An out-of-memory trial is never retried unchanged: the same layout needs the same memory. A
trial that failed because the cluster lost a node (``Measurement.lost_nodes``) is rerun at once
(same trial, next attempt) without using a retry, ``LOST_NODE_RETRIES`` times at most: the runner
waits for the node before the rerun.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Literal

from pipette.measurement import Measurement, last_error_line
from pipette.trials import TrialRecord

#: reruns of one trial that failed because a node was lost (beyond ``TuneOptions.retries``)
LOST_NODE_RETRIES = 2
#: a crash is retried when the chance that a retry of its kind runs (``retry_chance``) is at
#: least this: a retry costs one trial, as the next candidate would, and is worth it when it
#: is at least as likely as not to run.
RETRY_MIN_CHANCE = 0.5

#: the key of a crashed attempt's ``Measurement.extra`` that says its candidate is retried later
RETRY_LATER = "retry_later"
#: what a later retry waits for, as the crashed attempt's record says it
RETRY_LATER_TEXT = ("retried later, as a trial of its own, once another candidate has run, "
                    "while it is still predicted faster than the best measured")
#: the purpose of a retry's trial (``TrialRecord.purpose``)
RETRY = "retry"

#: what follows an attempt: a rerun after a lost node (at once), or the trial is done
Next = Literal["rerun", "done"]


@dataclass
class RetryPolicy:
    """One trial's retries (of its candidate, in this job) and lost-node reruns left (module docstring)."""

    retries_left: int
    lost_left: int = LOST_NODE_RETRIES

    def after(self, record: TrialRecord, earlier: Sequence[TrialRecord],
              cancelled: bool) -> tuple[Next, TrialRecord]:
        """What follows the attempt ``record`` (``earlier``: this job's records before it), and the
        record, with a ``not_retried`` note where a retry was left out so the user sees why."""
        m = record.measurement
        crashed = not cancelled and m.status in ("failed", "timeout")
        if crashed and m.lost_nodes and self.lost_left > 0:
            self.lost_left -= 1  # the cluster's failure, not the candidate's: rerun it
            return "rerun", record
        if not crashed or self.retries_left <= 0:
            return "done", record
        why = _not_retried(m, [*earlier, record])
        note = {"not_retried": why} if why is not None else {RETRY_LATER: RETRY_LATER_TEXT}
        return "done", replace(record, measurement=replace(m, extra={**m.extra, **note}))


def _not_retried(m: Measurement, records: Sequence[TrialRecord]) -> str | None:
    """Why a crash is not worth a retry, or None when it is."""
    if m.details.script_fault or m.details.unsupported:
        why = ("the script's own failure, which no layout explains" if m.details.script_fault else
               "the script says it cannot run this candidate")
        return f"{why}: a retry would repeat it"
    chance = retry_chance(records, crash_kind(m))
    if chance >= RETRY_MIN_CHANCE:
        return None
    return (f"a retry of this kind of crash ({m.status}: {last_error_line(m.error or '')[:200]}) "
            f"ran with chance {chance:.0%} in this job (< {RETRY_MIN_CHANCE:.0%}): its earlier retries crashed again")


def crash_kind(m: Measurement) -> str:
    """What kind of crash a failed attempt was: its status and the line of its error that names
    the exception (``last_error_line``), numbers blanked, so that two crashes of one kind on
    other ranks, ports or sizes are the same kind."""
    blanked = re.sub(r"0x[0-9a-fA-F]+|\d+", "#", last_error_line(m.error or ""))
    return f"{m.status}: {blanked[:200]}"


def retry_chance(records: Sequence[TrialRecord], kind: str) -> float:
    """The chance that a retry of a crash of ``kind`` runs, by Laplace's rule of succession
    over this job's retries of that kind so far: (runs + 1) / (retries + 2); 1/2 before any.

    A retry that crashed again is evidence that the crash is the candidate's (a pipeline depth
    the model does not split evenly, a kernel that fails), not the machine's (a timed-out
    collective, a lost peer): one such and the chance is 1/3, and the kind is not retried
    again in this job (a resumed job counts its stored records the same way). A retry is a
    trial of purpose ``RETRY`` (its crash: the candidate's attempt before it), or, in records
    written before retries waited, the next attempt of the same trial. Reruns after a lost node
    are not retries."""
    ran = tried = 0
    for before, after in _retries(records):
        if before.status in ("failed", "timeout") and crash_kind(before) == kind:
            tried += 1
            ran += after.status not in ("failed", "timeout")
    return (ran + 1) / (tried + 2)


def _retries(records: Sequence[TrialRecord]) -> list[tuple[Measurement, Measurement]]:
    """(the crash, its retry) of every retry in ``records``, lost-node attempts left out."""
    out: list[tuple[Measurement, Measurement]] = []
    by_number: dict[int, list[TrialRecord]] = {}
    last: dict[str, TrialRecord] = {}
    for r in records:
        if r.measurement.lost_nodes:
            continue
        if r.purpose == RETRY and r.label in last:
            out.append((last[r.label].measurement, r.measurement))
        by_number.setdefault(r.number, []).append(r)
        last[r.label] = r
    for attempts in by_number.values():
        own = [r.measurement for r in sorted(attempts, key=lambda r: r.attempt)]
        out.extend(pairwise(own))
    return out


def retries_of(records: Sequence[TrialRecord], label: str) -> int:
    """The retries of candidate ``label`` in ``records`` (trials of purpose ``RETRY``)."""
    return sum(r.purpose == RETRY and r.label == label for r in records)


def deferred(records: Sequence[TrialRecord]) -> list[tuple[TrialRecord, bool]]:
    """The crashed attempts whose candidate is to be retried later (``RETRY_LATER``) and has had
    no attempt since, each with whether a trial of another candidate ran ok after it. One whose
    kind's retries have since crashed again (``retry_chance``) is left out: it is not retried."""
    out = []
    for i, r in enumerate(records):
        later = records[i + 1:]
        if (r.measurement.extra.get(RETRY_LATER) and not any(x.label == r.label for x in later)
                and retry_chance(records, crash_kind(r.measurement)) >= RETRY_MIN_CHANCE):
            out.append((r, any(x.status == "ok" for x in later)))
    return out
