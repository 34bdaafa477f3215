"""``pipette.report``: the events a user's script writes in a trial, when it is told to stop,
and that it does nothing outside a trial."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

from pipette import report
from pipette.report import EVENT_PREFIX, TRIAL_ENV, HFCallback, Reporter

TRIAL = {TRIAL_ENV: json.dumps({"warmup_steps": 1, "timed_steps": 2}), "RANK": "3"}


class Clock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def _events(stream: io.StringIO) -> list[dict[str, object]]:
    lines = stream.getvalue().splitlines()
    assert all(line.startswith(EVENT_PREFIX) for line in lines)
    return [json.loads(line[len(EVENT_PREFIX):]) for line in lines]


def test_outside_a_trial_it_writes_nothing_and_never_stops() -> None:
    stream = io.StringIO()
    reporter = Reporter(environ={}, stream=stream)
    assert not any(reporter.step(loss=1.0, samples=8) for _ in range(100))
    reporter.loss(0.5)
    reporter.done()
    assert stream.getvalue() == "" and reporter.losses == []


def test_a_trial_gets_warmup_and_timed_steps_then_stop() -> None:
    stream = io.StringIO()
    reporter = Reporter(environ=TRIAL, stream=stream, clock=Clock(0.0, 1.0, 3.0, 3.5, 4.25))
    reporter.begin()  # 1.0
    assert reporter.step(loss=2.0, samples=16) is False  # 3.0: warm-up, 2 s
    assert reporter.step(loss=1.5, samples=16) is False  # 3.5
    assert reporter.step(loss=1.0, samples=16) is True  # 4.25: warm-up + 2 timed
    reporter.done(peak_memory_bytes=1234)
    reporter.done()  # once only
    events = _events(stream)
    assert [e["event"] for e in events] == ["step", "step", "step", "done"]
    assert [e["warmup"] for e in events[:3]] == [True, False, False]
    assert [e["time"] for e in events[:3]] == [2.0, 0.5, 0.75]
    assert all(e["rank"] == 3 and e["samples"] == 16 and e["source"] == "reporter" for e in events[:3])
    done = events[3]
    assert done["step_times"] == [0.5, 0.75] and done["losses"] == [2.0, 1.5, 1.0] and done["steps"] == 3
    assert done["peak_memory_bytes"] == 1234 and int(done["peak_rss_bytes"]) > 0  # type: ignore[call-overload]
    assert report.REPORTING


def test_a_step_time_the_script_measured_itself_is_used() -> None:
    stream = io.StringIO()
    reporter = Reporter(environ=TRIAL, stream=stream, clock=Clock(0.0, 10.0, 20.0))
    reporter.step(step_time=0.125)
    reporter.step(step_time=0.25, peak_memory_bytes=99)
    events = _events(stream)
    assert [e["time"] for e in events] == [0.125, 0.25] and events[1]["peak_memory_bytes"] == 99


def test_the_hf_callback_reports_steps_losses_and_the_trainers_figures() -> None:
    stream = io.StringIO()
    callback = HFCallback(Reporter(environ=TRIAL, stream=stream, clock=Clock(0.0, 0.0, 1.0, 2.0, 3.0)))
    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=2, world_size=4)
    state = SimpleNamespace()
    control = SimpleNamespace(should_training_stop=False)
    callback.on_train_begin(args, state, control)
    for _ in range(3):
        control = callback.on_step_end(args, state, control)
        callback.on_log(args, state, control, logs={"loss": 4.0, "learning_rate": 1e-3})
    assert control.should_training_stop is True
    callback.on_log(args, state, control, logs={"train_samples_per_second": 12.5, "train_loss": 3.9})
    assert callback.on_evaluate(args, state, control) is control  # events it does not use: no-ops
    callback.on_train_end(args, state, control)
    events = _events(stream)
    assert [e["samples"] for e in events[:3]] == [16, 16, 16]
    done = events[-1]
    assert done["event"] == "done" and done["losses"] == [4.0, 4.0, 4.0]
    assert done["log"] == {"train_samples_per_second": 12.5, "train_loss": 3.9}


def test_the_hf_callback_without_batch_figures_reports_no_samples() -> None:
    stream = io.StringIO()
    callback = HFCallback(Reporter(environ=TRIAL, stream=stream, clock=Clock(0.0, 1.0)))
    control = SimpleNamespace(should_training_stop=False)
    callback.on_step_end(SimpleNamespace(), SimpleNamespace(), control)
    assert "samples" not in _events(stream)[0]
