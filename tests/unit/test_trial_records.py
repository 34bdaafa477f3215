"""Trial records (``pipette.trials``): every format the CLI has written loads, a record round
trips whole, the typed details read what the workers write, and the JSON-lines store refuses a
line it cannot read by its file and line. The contract both stores keep is in
``tests/service/test_trial_store.py`` (the JSON-lines file and the database, side by side)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pipette.errors import PipetteError, StoreError
from pipette.measurement import Allocator, Details, Measurement
from pipette.trials import JsonlTrialStore, TrialRecord
from tests.trial_records import FIXTURES, ROOT, a_plan, a_record

FORMATS = sorted(p.name for p in FIXTURES.glob("*.jsonl"))


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_the_cli_wrote_loads(name: str) -> None:
    ok, failed = JsonlTrialStore(FIXTURES / name).records()
    assert (ok.number, ok.status, failed.number, failed.status) == (0, "ok", 1, "failed")
    assert ok.measurement.step_times == (0.31, 0.30, 0.32) and ok.measurement.peak_memory == (2**27, 2**28)
    assert ok.job_key == "0123456789abcdef" and ok.predicted_sd == 0.2
    # keys added since take what an older record meant
    assert (ok.stack, ok.purpose, ok.measurement.statistic) == ("pipette", "search", "median")
    assert ok.started_at is None and ok.ended_at is None and ok.extra == {}
    # the derived keys are recomputed, in today's conventions: the first format's error_pct
    # was (predicted - measured) / measured and its predicted_peak_bytes counted the overhead
    stored = json.loads((FIXTURES / name).read_text().splitlines()[0])
    assert ok.error_pct == ok.to_dict()["error_pct"] == pytest.approx(100 * (0.31 - 0.29) / 0.29)
    assert stored["error_pct"] < 0 if name.startswith("2026-11-21") else stored["error_pct"] > 0
    assert ok.predicted_peak_bytes == ok.memory.peak_bytes - ok.memory.breakdown["overhead"]
    assert ok.details.wall_s == 21.5 and ok.details.peak_rss_bytes == (501_000_000, 498_000_000)
    assert failed.measurement.error.endswith("RuntimeError: boom")
    assert failed.details.output_tail == "RuntimeError: boom"
    assert failed.error_pct is None
    # and what it reads, it writes back whole
    assert TrialRecord.from_dict(ok.to_dict()) == ok


def test_a_record_round_trips_whole_through_the_file(tmp_path: Path) -> None:
    store = JsonlTrialStore(tmp_path / "trials" / "c.jsonl")
    records = [a_record(0), a_record(1, attempt=2, purpose="retime", stack="fsdp"),
               a_record(2, extra={"from_a_newer_pipette": {"kept": [1, 2]}})]
    for r in records:
        store.append(r)
    back = store.records()
    assert back == records
    assert [r.to_dict() for r in back] == [r.to_dict() for r in records]
    # a key this version does not know is written back as it was
    assert json.loads(store.path.read_text().splitlines()[2])["from_a_newer_pipette"] == {"kept": [1, 2]}
    assert store.count() == 3 and store.find(records[1].label) == [records[1]]
    assert store.records(job_key="another job") == []


def test_the_details_read_what_the_workers_write() -> None:
    d = a_record().details
    assert d == Details(wall_s=21.5, backend="deepspeed+zero1", phases={"imports": 3.25, "steps": 1.5},
                        stopped_in=None,
                        allocator=Allocator(peak_reserved_bytes=(2**28, 2**28 + 4096),
                                            outside_allocator_bytes=(2**20, 2**21)),
                        peak_rss_bytes=(501_000_000, 498_000_000), output_tail="step 3 done")
    timed_out = Measurement("timeout", extra={"wall_s": 180.0, "backend": None, "phase": "ops",
                                              "not_retried": "crashed again"})
    assert timed_out.details == Details(wall_s=180.0, stopped_in="ops", not_retried="crashed again")
    assert Measurement("ok").details == Details()


def test_the_allocator_fields_are_the_ones_the_workers_send() -> None:
    source = next(text for p in (ROOT / "workers").rglob("*.py") if "ALLOCATOR_FIELDS = (" in (text := p.read_text()))
    sent = source.split("ALLOCATOR_FIELDS = (", 1)[1].split(")", 1)[0]
    assert sorted(f.strip().strip('"') for f in sent.replace("\n", " ").split(",") if f.strip()) == \
        sorted(Allocator.__dataclass_fields__)


@pytest.mark.parametrize(("line", "why"), [
    ('{"number": 1, "attempt": 1, "lab', "not JSON: Unterminated string"),
    ("[1, 2]", "is a JSON list, not an object"),
    ('{"number": 0}', "has no 'perf' key"),
    ("\xff\xfe", "not UTF-8"),
])
def test_a_line_that_is_not_a_record_is_named_with_its_fix(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "c.jsonl"
    good = json.dumps(a_record().to_dict())
    path.write_bytes(good.encode() + b"\n" + line.encode("latin-1") + b"\n" + good.encode() + b"\n")
    with pytest.raises(StoreError) as caught:
        JsonlTrialStore(path).records()
    e = caught.value
    assert isinstance(e, PipetteError)  # the CLI prints it as one line, no traceback
    assert e.field == str(path) and e.message.startswith("line 2 is not a trial record (") and why in e.message
    assert e.fix is not None and "delete or repair line 2" in e.fix and "--no-memory" in e.fix


def test_a_bad_value_is_named_too(tmp_path: Path) -> None:
    data = a_record().to_dict()
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({**data, "perf": 1.5}) + "\n")
    with pytest.raises(StoreError, match=r"line 1 is not a trial record \(has a value of the wrong kind \(TypeError"):
        JsonlTrialStore(path).records()
    data["measurement"]["status"] = "exploded"
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(StoreError, match=r"line 1 is not a trial record \(trial.measurement.status: status 'exploded'"):
        JsonlTrialStore(path).count()


def test_a_cut_last_line_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    """A crash while writing leaves a line without its end: the next record goes on a line of
    its own, so the reader names the cut line alone and nothing after it is lost."""
    store = JsonlTrialStore(tmp_path / "c.jsonl")
    store.append(a_record(0))
    with store.path.open("a") as f:
        f.write('{"number": 1, "attem')
    store.append(a_record(2))
    lines = store.path.read_text().splitlines()
    assert len(lines) == 3 and TrialRecord.from_dict(json.loads(lines[2])) == a_record(2)
    with pytest.raises(StoreError, match="line 2 is not a trial record"):
        store.records()


def test_blank_lines_and_a_missing_file_are_no_records(tmp_path: Path) -> None:
    assert JsonlTrialStore(tmp_path / "none.jsonl").records() == []
    path = tmp_path / "c.jsonl"
    path.write_text("\n" + json.dumps(a_record().to_dict()) + "\n\n")
    assert JsonlTrialStore(path).records() == [a_record()]


def test_an_unreadable_store_says_so(tmp_path: Path) -> None:
    (tmp_path / "c.jsonl").mkdir()
    with pytest.raises(StoreError, match="cannot read it") as caught:
        JsonlTrialStore(tmp_path / "c.jsonl").records()
    assert caught.value.field == str(tmp_path / "c.jsonl")
    with pytest.raises(StoreError, match="cannot append to it"):
        JsonlTrialStore(tmp_path / "c.jsonl").append(a_record())


def test_the_tuner_stamps_its_records_and_hands_them_over_typed() -> None:
    from pipette.tuner import TuneOptions, Tuner

    plan = a_plan()
    training = plan.training
    events = []

    def runner(config: object, on_step: object) -> Measurement:
        return Measurement("ok", (0.5, 0.5, 0.5), training.tokens_per_step)

    before = datetime.now(UTC)
    result = Tuner(plan, TuneOptions(max_trials=2, retime=0)).run(runner, on_event=events.append)
    ended = [e for e in events if e.kind == "trial_ended"]
    assert [e.record for e in ended] == list(result.trials)
    assert all(e.data == e.record.to_dict() for e in ended if e.record is not None)
    for r in result.trials:
        assert r.started_at is not None and r.ended_at is not None and before <= r.started_at <= r.ended_at
