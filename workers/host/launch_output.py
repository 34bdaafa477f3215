"""What ``launch.sh`` shows of a launch of Pipette's runner (issue 43, item 20).

The ranks report to stdout as ``@@pipette {...}`` event lines (``pipette.contract``), and the
launchers log at INFO: raw on a terminal they buried what a user wants to see, and nothing said how
the launch went. ``launch.sh`` pipes the launch's output (stdout and stderr) through this module:
every line goes to the log file beside the launch files (``launch.log``; across nodes
``launch-node<N>.log``); the terminal gets the lines a person reads (the ranks' phases once each,
the first reporting rank's steps, warnings, errors and anything else the launch prints), and at the
end one line with the step time and tokens/s this node's ranks measured (the lowest rank's steps
are shown as they come). Standard library and
``pipette`` only: it runs beside the launcher, not in a rank.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
from pathlib import Path
from typing import IO, Any

from pipette.contract import EVENT_PREFIX
from workers.phases import WORDS

#: A launcher's own log line below WARNING: ``[2026-12-04 13:53:24,950] [INFO] [launch.py:152:main] ...``
#: (DeepSpeed), ``[I1204 13:53:24.950 ...]``-style lines are not INFO of ours to hide.
_QUIET = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] \[(DEBUG|INFO)\]")
#: DeepSpeed's note each rank prints after loading its JIT-built op
_OP_LOADED = re.compile(r"^DeepSpeed \S+ built successfully$")


class LaunchView:
    """Turns a launch's output lines into what the terminal shows, and keeps what the summary needs."""

    def __init__(self) -> None:
        self.phases: set[str] = set()
        self.ranks: set[int] = set()  # the ranks here, as they said (``rank`` events)
        self.step_rank: int | None = None  # the rank whose steps are shown: the lowest here
        self.done: list[dict[str, Any]] = []
        self.hidden = 0

    def feed(self, line: str) -> str | None:
        """What to show for ``line`` (without its newline), or None."""
        if line.startswith(EVENT_PREFIX):
            try:
                event = json.loads(line[len(EVENT_PREFIX):])
            except json.JSONDecodeError:
                return line
            return self.event(event)
        if _QUIET.match(line) or _OP_LOADED.match(line):
            self.hidden += 1
            return None
        return line

    def event(self, event: dict[str, Any]) -> str | None:
        kind = event.get("event")
        if kind == "phase":
            phase = str(event.get("phase"))
            if phase in self.phases or phase == "end":
                return None
            self.phases.add(phase)
            return f"ranks: {WORDS.get(phase, phase)}"
        if kind == "rank":
            self.ranks.add(int(event.get("rank", 0)))
            return None
        if kind == "step":
            rank = int(event.get("rank", 0))
            if self.step_rank is None:
                self.step_rank = min(self.ranks, default=rank)
            if rank != self.step_rank:
                return None
            loss = event.get("loss")
            return (f"step {event.get('step')}{' (warm-up)' if event.get('warmup') else ''}: "
                    f"{float(event.get('time', 0.0)):.3f} s" + (f", loss {loss:.4f}" if loss is not None else "")
                    + f" (rank {rank})")
        if kind == "done":
            self.done.append(event)
        return None

    def summary(self, tokens_per_step: int, label: str, tuned: float | None) -> str:
        """The closing line: this node's step time (per timed step, the slowest of its ranks that
        timed it; the median over the steps) and tokens/s, beside the step time the tune measured."""
        timed = [list(map(float, e.get("step_times") or [])) for e in self.done]
        timed = [t for t in timed if t]
        if not timed:
            return f"launch of {label}: no rank reported its steps (the whole output is in the log)"
        steps = [max(per_rank) for per_rank in zip(*timed, strict=False)]
        step = statistics.median(steps)
        compare = f"; its trials measured {tuned:.4f} s" if tuned else ""
        ranks = f"{len(self.done)} rank{'' if len(self.done) == 1 else 's'}"
        return (f"launch of {label}: {len(steps)} timed steps on {ranks} here: step time {step:.4f} s "
                f"(median), {tokens_per_step / step:,.0f} tokens/s{compare}")


def _candidate_facts(path: str) -> tuple[int, str, float | None]:
    """(tokens per step, the candidate's label, the step time its trials measured) from candidate.json."""
    from pipette.config import ParallelConfig
    from pipette.training import TrainingSpec

    data = json.loads(Path(path).read_text())
    training = TrainingSpec.from_dict(data["training"])
    label = ParallelConfig.from_dict(data["config"]).label
    measured = (((data.get("tuning") or {}).get("best") or {}).get("step_time_s") or {}).get("measured")
    return training.tokens_per_step, label, float(measured) if measured else None


def show(stream: IO[str], log: IO[str], out: IO[str], candidate: str) -> None:
    view = LaunchView()
    for raw in stream:
        log.write(raw)
        log.flush()
        shown = view.feed(raw.rstrip("\n"))
        if shown is not None:
            out.write(shown + "\n")
            out.flush()
    tokens, label, tuned = _candidate_facts(candidate)
    out.write(view.summary(tokens, label, tuned) + f" (full output: {log.name})\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workers.host.launch_output")
    parser.add_argument("--candidate", required=True, help="the launch's candidate.json")
    parser.add_argument("--log", required=True, help="where every line of the launch's output goes")
    args = parser.parse_args(argv)
    # Ctrl-C reaches the launcher and this reader alike: the launcher stops its ranks; this reads
    # their output to its end, so the log and the summary keep what they said.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(args.log, "w") as log:
        show(sys.stdin, log, sys.stdout, args.candidate)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
