"""``pipette``: the command line.

The one edge module that may reach workers/ and service/, always lazily inside the command
that needs them, so ``pipette plan`` runs with the core alone. Each command is a module with
its ``add_parser``: ``plan``, ``tune``, and the service's client (``client``); the flags they
share are ``inputs``'.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cli import client, plan, tune
from cli.inputs import as_flags
from cli.signals import Terminated, exit_code, terminate_like_interrupt
from pipette.errors import PipetteError

EXIT_OK = 0
EXIT_ERROR = 1  # a PipetteError: bad input or nothing feasible
EXIT_USAGE = 2  # argparse's own code for a bad command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    terminate_like_interrupt()  # SIGTERM says what it stopped and exits 143, not silently
    try:
        code: int = args.func(args)
        return code
    except PipetteError as e:
        print(f"pipette: error: {as_flags(e) if getattr(args, 'recipe_flags', False) else e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        print("pipette: terminated (SIGTERM)" if isinstance(e, Terminated) else "pipette: interrupted",
              file=sys.stderr)
        return exit_code(e)
    except BrokenPipeError:  # `pipette plan | head`: the reader left, nothing to say
        sys.stderr.close()
        return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipette",
        description="Find the fastest parallel configuration that fits, for LLM training.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    plan.add_parser(sub)
    tune.add_parser(sub)
    client.add_parsers(sub)  # the service's client: serve, cluster, submit, jobs, watch, ...
    return parser


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
