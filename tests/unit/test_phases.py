"""What a trial caught before its end tells the user: the phase its ranks were in and the fix
(issue 32, item 2), and the live bar of ``pipette tune`` shows the phase and the elapsed time."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from cli.tune import Progress
from pipette.contract import EVENT_PREFIX
from workers.phases import earliest, script_timeout_text, timeout_text


def test_a_timeout_names_the_phase_and_the_flag_that_fixes_it() -> None:
    text = timeout_text(180, "ops", None)
    assert text == ("timed out after 180 s in its op build (DeepSpeed's CPU op) before its first step: "
                    "give it more time with --trial-timeout 360")
    assert len(text) <= 160  # a trial's line of `pipette tune` shows 160 characters
    assert timeout_text(60, "steps", 4).startswith("timed out after 60 s in its timed steps after step 4: ")
    assert "#" not in text


def test_a_scripts_timeout_says_the_fix_first_and_its_last_line() -> None:
    text = script_timeout_text(180, "Loading checkpoint shards: 50%")
    assert text.startswith("no step reported in 180 s: if it is still starting")
    assert "--trial-timeout 360" in text.splitlines()[0][:160]
    assert text.endswith("its last line: Loading checkpoint shards: 50%")


def test_the_rank_furthest_behind_holds_the_trial() -> None:
    assert earliest(["steps", "ops", "build"]) == "ops"
    assert earliest([]) is None


def test_a_rank_says_each_phase_it_enters() -> None:
    # as workers.rank.train and workers.rank.trial mark them: a warm-up step, the last one, two timed steps
    code = ("from workers.phases import PHASES; PHASES.begin(); PHASES.mark('start'); PHASES.mark('imports'); "
            "PHASES.mark('rendezvous'); PHASES.mark('ops'); PHASES.mark('build'); PHASES.mark('engine'); "
            "PHASES.mark('warmup'); PHASES.mark('warmup', then='steps'); PHASES.mark('steps', then='steps'); "
            "PHASES.mark('steps'); PHASES.mark('steps', then='steps'); print(PHASES.current()); PHASES.mark('end')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    said = [json.loads(line[len(EVENT_PREFIX):])["phase"] for line in out.splitlines() if line.startswith(EVENT_PREFIX)]
    # once each, as entered: a hang in the timed steps is in the steps (it read "end" before)
    assert said == ["start", "imports", "rendezvous", "ops", "build", "engine", "warmup", "steps", "end"]
    assert "steps" in out.splitlines()


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_live_bar_shows_the_phase_and_the_elapsed_time() -> None:
    out = Tty()
    ui = Progress(8, out)
    ui.start(0, {"label": "tp1-pp1-dp4-mbs4-z2", "attempt": 1})
    ui.phase("ops", 45.2)
    assert out.getvalue().endswith("running #0 tp1-pp1-dp4-mbs4-z2, op build (DeepSpeed's CPU op), 45 s")
    ui.step({})
    ui.phase("steps", 61.0)
    assert out.getvalue().endswith("running #0 tp1-pp1-dp4-mbs4-z2, step 1, 61 s")
