"""How the CLI ends at a signal: SIGTERM is handled like Ctrl-C (SIGINT), and both exit with
the shell's code for them, 128 + the signal's number (130 SIGINT, 143 SIGTERM), in every
command (``tune``, ``serve``, the client's)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_SIGINT = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python raises ``KeyboardInterrupt`` for SIGINT: a subclass, so
    every place that stops cleanly at Ctrl-C (the tuner, uvicorn, the client) does so here."""


def raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def terminate_like_interrupt() -> None:
    """Make SIGTERM raise ``Terminated`` in this (main) thread. Ray's ``init`` installs its
    own handler (``sys.exit(15)``: exit code 15, nothing printed), so a command that starts Ray
    calls this again after it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_terminated)


def exit_code(interrupt: BaseException | int) -> int:
    """130 for Ctrl-C, 143 for SIGTERM (an exception or a signal number)."""
    if isinstance(interrupt, int):
        return 128 + interrupt
    return EXIT_SIGTERM if isinstance(interrupt, Terminated) else EXIT_SIGINT


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
