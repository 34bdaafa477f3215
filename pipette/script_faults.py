"""Failures of a user's script that no layout explains: the search stops at the first one.

A script that cannot import a module, does not parse, refuses its own command line, exits
without training a step, or ignores what Pipette gives it fails the same way on every
candidate: trying the next one only repeats it (issue 43, item 26: a missing import failed 5
trials and a retry, then the untried candidates were called "likely to fail as tried ones
did"). ``script_fault`` reads a failed script trial's error and output and says what it was and
how to fix it; the tuner stops there (``pipette.tuner``). Pure: strings in, strings out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipette.measurement import last_error_line
from pipette.script import ScriptSpec

#: argparse's last line on a bad command line (``prog: error: message``), a rank prefix allowed
_ARGPARSE = re.compile(r"^(?:\[rank\d+\]:\s*)?(\S+): error: (.+)$", re.M)
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.+)$")
#: transformers' HfArgumentParser refuses flags it does not know this way instead
_HF_UNUSED = re.compile(r"Some specified arguments are not used by the HfArgumentParser: \[(.*)\]")
_EXCEPTION = re.compile(r"(ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError): (.*)$")
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
#: the executor's own words for a script that ran but ignored what the candidate asked, or
#: reported nothing (``workers.host.script_trial``): every candidate would end the same way
OWN_WORDS = ("the script exited without error but", "the script trains without", "the script ignores")


@dataclass(frozen=True)
class ScriptFault:
    """A failure of the script itself: what it was (one line) and how to fix it."""

    what: str
    fix: str


def script_fault(error: str, output: str, script: ScriptSpec | None = None, python: str = "python") -> \
        ScriptFault | None:
    """The fault of the script that ended a trial with ``error`` after printing ``output`` (the
    failing rank's), or None when a layout may explain it (out of memory, a crash mid-run, a
    timeout). ``python``: the interpreter the trials run, named in the fix of a missing module."""
    for words in OWN_WORDS:
        if error.startswith(words):
            first = error.splitlines()[0]
            return ScriptFault(first, "change the script as its error says, then tune again")
    text = f"{output}\n{error}"
    return _exception(text, python) or _argparse(text, script)


def _exception(text: str, python: str) -> ScriptFault | None:
    # the exception that ended the script (its last), not an earlier warning that names one
    found = _EXCEPTION.match(last_error_line(text))
    if not found:
        return None
    kind, message = found.group(1), found.group(2).strip()
    what = f"{kind}: {message}"[:300]
    if kind == "ModuleNotFoundError":
        name = re.search(r"No module named '([^']+)'", message)
        module = name.group(1).split(".")[0] if name else "the module"
        return ScriptFault(what, f"install {module} into the environment the trials run in ({python} -m pip install "
                                 f"{module}; its bin/ comes first on the script's PATH), or drop the import")
    if kind == "ImportError":
        return ScriptFault(what, "fix the import (the installed package may be another version than the script "
                                 f"expects: {python} -m pip show it), then run the script once by hand")
    where = list(_FILE_LINE.finditer(text))
    place = f" at {where[-1].group(1)}, line {where[-1].group(2)}" if where else ""
    return ScriptFault(what, f"fix the script's syntax{place} ({python} -m py_compile SCRIPT finds it)")


def _argparse(text: str, script: ScriptSpec | None) -> ScriptFault | None:
    hf = _HF_UNUSED.search(text)
    if hf:
        flags = [w.strip(" '\"") for w in hf.group(1).split(",") if w.strip(" '\"").startswith("-")]
        return ScriptFault(f"the script's argument parser refused {' '.join(flags) or hf.group(1)}",
                           _unknown_flags_fix(flags, script))
    found = list(_ARGPARSE.finditer(text))
    if not found or "usage:" not in text:
        return None
    prog, message = found[-1].group(1), found[-1].group(2).strip()
    what = f"{prog}: error: {message}"[:300]
    unknown = _UNRECOGNIZED.search(message)
    if unknown:
        return ScriptFault(what, _unknown_flags_fix([w for w in unknown.group(1).split() if w.startswith("-")],
                                                    script))
    return ScriptFault(what, f"give the script the command line its usage asks for (python {prog} --help)")


def _unknown_flags_fix(flags: list[str], script: ScriptSpec | None) -> str:
    """The fix for flags the script does not take: a knob Pipette added is cleared or renamed;
    any other came with the command."""
    knobs = {flag: name for name, flag in (script.knobs if script is not None else {}).items()}
    ours = [f for f in flags if f in knobs]
    theirs = [f for f in flags if f not in knobs]
    parts = []
    if ours:
        names = ", ".join(f"{knobs[f]} ({f})" for f in ours)
        parts.append(f"Pipette passed the knob {names}: give the script's own flag (--script-knob "
                     f"{knobs[ours[0]]}=--its_flag) or clear it (--script-knob {knobs[ours[0]]}=)")
    if theirs:
        parts.append(f"drop {' '.join(theirs)} from the command after --script (Pipette's own flags go before "
                     "--script)")
    return "; ".join(parts) or "give the script only the flags it takes"


#: an error that says the script cannot run what it was given (not a crash of the machine)
_UNSUPPORTED = re.compile(r"NotImplementedError|not (?:yet )?supported|unsupported|does not support|"
                          r"is not implemented", re.I)


def unsupported_hint(error: str, output: str, uses: list[str]) -> str | None:
    """When a failed trial's error says the script does not support what it was given (its
    exception line: ``NotImplementedError``, "... not supported"), the fix naming what of the
    candidate it may be (``uses``: among ``pipette.script.UNSUPPORTED``'s names); None otherwise.
    Such a failure is the candidate's in this script: a retry repeats it."""
    line = last_error_line(f"{output}\n{error}")
    if not _UNSUPPORTED.search(line):
        return None
    said = ",".join(uses) if uses else "WHAT"
    return (f"the script says it cannot run this candidate ({line[:200]}): if it cannot run {' or '.join(uses) or 'it'}"
            f", tune with --script-unsupported {said} so that no such candidate is tried")
