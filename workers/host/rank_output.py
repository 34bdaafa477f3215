"""A rank's output as the host reads it: its event lines (``pipette.contract``), the tail of the
rest, and its exit, whichever transport started it (``workers.host.transport``)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable

from pipette.contract import split_event

#: How long a rank's exit waits to be reported for the rest of its output to be read: the
#: reader may be behind when the rank exits (a script's last line, its ``done`` event, is
#: written just before its exit). Bounded: a child the rank left behind can hold the pipe open.
DRAIN_S = 5.0


class RankOutput:
    """A rank's output as it is read: its event lines, the tail of the rest, and its exit,
    reported only once the output written before it has been read (or ``DRAIN_S`` after it)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.lock = threading.Lock()
        self.reader: threading.Thread | None = None
        self.exited_at: float | None = None

    def follow(self, lines: Iterable[str]) -> None:
        """Read ``lines`` (until they end) in a thread of their own."""
        self.reader = threading.Thread(target=self._read, args=(lines,), daemon=True)
        self.reader.start()

    def _read(self, lines: Iterable[str]) -> None:
        for line in lines:
            # An event may follow a progress bar's carriage return on one line (stdout and
            # stderr share the pipe): it starts at its prefix wherever that is.
            event, text = split_event(line)
            with self.lock:
                if event is not None:
                    self.events.append(event)
                if text.strip() or event is None:
                    self.tail.append(text)

    def take(self, code: int | None) -> tuple[list[str], int | None]:
        """The event lines read since the last call, and ``code`` (the rank's exit status, None
        while it runs), held back as None while the output before that exit is still being read."""
        if code is not None and self.reader is not None and self.reader.is_alive():
            now = time.monotonic()
            self.exited_at = self.exited_at or now
            if now - self.exited_at < DRAIN_S:
                self.reader.join(timeout=0.05)
                if self.reader.is_alive():
                    code = None
        with self.lock:
            events, self.events = self.events, []
        return events, code

    def text(self) -> str:
        """The last lines of the output that are not events."""
        with self.lock:
            return "\n".join(self.tail)
