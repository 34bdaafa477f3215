"""The client commands of ``pipette``: they talk to the service's REST API (see docs/cli-and-dashboard.md, "CLI
and dashboard"). ``add_parsers`` registers them next to the offline ``plan`` and ``tune``.

Conventions (like ``gh`` and ``kubectl``): tables for people, ``--json`` for scripts, one line
on stderr for an error (the service's field and fix), exit codes scripts can rely on
(``client_api.EXIT_*``), colour only on a terminal, and examples in every ``--help``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from cli import client_admin, client_cluster, client_jobs, client_watch
from cli.client_api import EXIT_CODES_HELP, EXIT_ERROR, ApiError
from cli.inputs import add_option_flags
from cli.signals import Terminated, exit_code
from pipette.errors import PipetteError

Command = Callable[[argparse.Namespace], int]

ENV_HELP = """\
environment:
  PIPETTE_URL    the service (default: the login file's, else http://127.0.0.1:8000)
  PIPETTE_TOKEN  the API token (default: the login file's)
  PIPETTE_CONFIG the login file (default: ~/.config/pipette/config.json)
"""


def command(fn: Command) -> Command:
    """Print an error as one line and return its exit code (``ApiError.exit_code``)."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ApiError as e:
            print(f"pipette: error: {e}", file=sys.stderr)
            return e.exit_code
        except PipetteError as e:
            print(f"pipette: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt as e:
            what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
            print(f"\npipette: {what}" + (" (the job goes on; `pipette watch` it again)"
                                              if fn in (client_watch.cmd_watch, client_jobs.cmd_submit) else ""),
                  file=sys.stderr)
            return exit_code(e)
        except BrokenPipeError:  # `pipette trials JOB | head`: stop quietly, as `cat` does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return run


def _add(sub: Any, name: str, fn: Command, help_text: str, examples: str, description: str | None = None,
         env: bool = True) -> argparse.ArgumentParser:
    epilog = "examples:\n" + examples.rstrip() + "\n\n" + (ENV_HELP + "\n" if env else "") + EXIT_CODES_HELP
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help_text, description=description or help_text[0].upper() + help_text[1:] + ".",
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=command(fn))
    return parser


def _json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout (for scripts)")


def add_parsers(sub: Any) -> None:
    _add_service(sub)
    _add_cluster(sub)
    _add_jobs(sub)


def _add_service(sub: Any) -> None:
    p = _add(sub, "serve", client_admin.cmd_serve, "run the service (API, scheduler, dashboard) on this machine",
             "  pipette serve                          # SQLite under ~/.pipette, a local Ray, port 8000\n"
             "  PIPETTE_HOME=/tmp/p pipette serve --port 8100\n"
             "  PIPETTE_DATABASE_URL=postgresql://db/pipette RAY_ADDRESS=head:6380 pipette serve --host 0.0.0.0",
             "Run the service with its scheduler: the REST API under /v1, the dashboard at /, jobs run on a "
             "local Ray (or RAY_ADDRESS). On the embedded SQLite database the schema is upgraded first; "
             "PostgreSQL is upgraded by `pipette-admin migrate`.", env=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--no-migrate", action="store_true", help="do not upgrade the SQLite database first")

    p = _add(sub, "login", client_admin.cmd_login, "save the service's URL and your token for the other commands",
             "  pipette login --url http://127.0.0.1:8000            # asks for the token\n"
             "  echo \"$TOKEN\" | pipette login --url https://pipette.example.com --with-token",
             "Check the token against the service and save the URL and the token in the login file "
             "(mode 0600).")
    p.add_argument("--url", help="the service (default: PIPETTE_URL, the saved one, or http://127.0.0.1:8000)")
    p.add_argument("--with-token", action="store_true", help="read the token from stdin")

    token = sub.add_parser("token", help="API tokens (admin: runs where the service's database is)",
                           description="API tokens (admin).").add_subparsers(title="token commands", metavar="ACTION")
    p = _add(token, "create", client_admin.cmd_token_create, "create a token for a tenant and print it (once)",
             "  pipette token create --tenant ml-team\n"
             "  pipette token create --tenant me --login      # and save it as your login\n"
             "  PIPETTE_DATABASE_URL=postgresql://db/pipette pipette token create --tenant ci --json",
             "Create an API token for a tenant in the service's database (PIPETTE_HOME or PIPETTE_DATABASE_URL) "
             "and print it; only its hash is stored. Tokens see only their tenant's clusters and jobs.", env=False)
    p.add_argument("--tenant", required=True, help="the tenant the token belongs to")
    p.add_argument("--name", default="", help="a label for the token")
    p.add_argument("--login", action="store_true", help="also save it as this user's login (with PIPETTE_URL)")
    _json(p)

    p = _add(sub, "demo", client_admin.cmd_demo, "start the service, run the tiny CPU job, print the best config",
             "  pipette demo\n  PIPETTE_HOME=/tmp/pipette-demo pipette demo --port 8100",
             "The whole loop on this machine: start the service on embedded defaults (unless one answers), "
             "log in, register this machine as 2 CPU devices, submit examples/jobs/tiny-cpu.yaml, watch it, "
             "write the best configuration's files and print the dashboard's address.")
    p.add_argument("--port", type=int, default=8000, help="port of the service (default 8000)")
    p.add_argument("--job", help="a job file (default examples/jobs/tiny-cpu.yaml)")
    p.add_argument("-o", "--out", default="pipette-best", help="where to write the best config (pipette-best)")


def _add_cluster(sub: Any) -> None:
    cluster = sub.add_parser("cluster", help="register, list, show, profile and delete clusters",
                             description="The clusters jobs run on.").add_subparsers(title="cluster commands",
                                                                                     metavar="ACTION")
    p = _add(cluster, "add", client_cluster.cmd_add, "register a cluster",
             "  pipette cluster add local --devices 2                 # this machine, 2 CPU worker devices\n"
             "  pipette cluster add a100s --ray 10.0.0.1:6380 --devices 8\n"
             "  pipette cluster add pair --ray head:6380 --node gpu0=8@10.0.0.1 --node gpu1=8@10.0.0.2",
             "Register the embedded local cluster (this host's Ray, CPU devices with gloo where there is no GPU) "
             "or a Ray cluster and the nodes and devices jobs may use.")
    p.add_argument("name", help="a name, unique among your clusters")
    p.add_argument("--devices", type=int, default=2, help="devices per node (default 2)")
    p.add_argument("--ray", metavar="ADDRESS", help="a Ray cluster's address (default: the local embedded one)")
    p.add_argument("--node", action="append", metavar="NAME=DEVICES[@ADDRESS]", help="a node to use (repeat)")
    _json(p)
    p = _add(cluster, "list", client_cluster.cmd_list, "list your clusters",
             "  pipette cluster list\n  pipette cluster list --json | jq -r '.[].name'")
    _json(p)
    p = _add(cluster, "show", client_cluster.cmd_show, "show a cluster's devices and measured links",
             "  pipette cluster show local\n  pipette cluster show local --json | jq .latest_profile.profile.links",
             "Show a cluster's inventory and latest profile: memory and compute per device, the link "
             "bandwidth matrix, slow links, and when it was measured.")
    p.add_argument("name", help="the cluster's name or id")
    _json(p)
    p = _add(cluster, "profile", client_cluster.cmd_profile, "measure a cluster (links, memory, compute)",
             "  pipette cluster profile local --wait\n  pipette cluster profile a100s",
             "Queue a measurement of the cluster; it runs when its devices are free. --wait follows it and "
             "shows the result.")
    p.add_argument("name", help="the cluster's name or id")
    p.add_argument("--wait", action="store_true", help="wait for the measurement and show it")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait at most (default 900)")
    _json(p)
    p = _add(cluster, "delete", client_cluster.cmd_delete, "delete a cluster (its finished jobs stay readable)",
             "  pipette cluster delete a100s",
             "Delete one of your clusters: it leaves your list and frees its name and its place under the "
             "clusters' cap. The jobs that ran on it stay readable. Refused while a job or profile of it is "
             "queued or running: cancel them or let them end first.")
    p.add_argument("name", help="the cluster's name or id")


def _add_jobs(sub: Any) -> None:
    _add_submit(sub)
    _add_job_progress(sub)
    _add_job_results(sub)


def _add_submit(sub: Any) -> None:
    """``pipette submit``: a job file, its overrides, and the tuning options' flags."""
    p = _add(sub, "submit", client_jobs.cmd_submit, "submit a tuning job from a job file",
             "  pipette submit examples/jobs/tiny-cpu.yaml --watch\n"
             "  pipette submit examples/jobs/llama2-7b-lora-8xa100.yaml --max-trials 6\n"
             "  id=$(pipette submit job.yaml --json | jq -r .id)",
             "Submit the job a YAML file describes (cluster, model, training, budget, name: what POST /v1/jobs "
             "takes; see examples/jobs/). The service checks every field. The tuning options' flags (as for "
             "`pipette tune`) override the file's budget.")
    p.add_argument("file", help="the job file (YAML or JSON)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a value, e.g. budget.max_trials=4")
    p.add_argument("--name", help="the job's name (overrides the file's)")
    p.add_argument("--watch", action="store_true", help="follow the job until it ends (exit code: how it ended)")
    _json(p, "the accepted job (with --watch: every event, one JSON object per line)")
    add_option_flags(p, "tune", overriding="the job file")  # `tune`'s flags, as the job's budget


def _add_job_progress(sub: Any) -> None:
    """The commands that list jobs and follow one: jobs, status, watch."""
    p = _add(sub, "jobs", client_jobs.cmd_jobs, "list jobs, newest first",
             "  pipette jobs\n  pipette jobs --state running --state queued\n"
             "  pipette jobs --cluster local --json | jq -r '.[] | select(.state==\"succeeded\") | .id'")
    p.add_argument("--state", action="append",
                   choices=["queued", "profiling", "planning", "running", "succeeded", "failed", "cancelled"],
                   help="only jobs in this state (repeat for several)")
    p.add_argument("--cluster", help="only jobs on this cluster (name or id)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    _json(p)

    p = _add(sub, "status", client_jobs.cmd_status, "show a job's state, progress and best so far",
             "  pipette status 5601acd3\n  pipette status 5601acd3 --json | jq .progress")
    p.add_argument("job", help="the job's id or its first characters")
    _json(p)

    p = _add(sub, "watch", client_watch.cmd_watch, "follow a job live: each trial, progress, best so far",
             "  pipette watch 5601acd3\n  pipette watch 5601acd3 && pipette best 5601acd3 -o best/\n"
             "  pipette watch 5601acd3 --json | jq -c 'select(.kind==\"trial_ended\")'",
             "Follow a job's event stream until it ends (from its first event): each trial as it starts and "
             "ends, with predicted and measured step time, a progress bar and the best so far.")
    p.add_argument("job", help="the job's id or its first characters")
    _json(p, "every event, one JSON object per line,")


def _add_job_results(sub: Any) -> None:
    """The commands on a job's trials and its best configuration, and its cancel: trials, best, cancel."""
    p = _add(sub, "trials", client_jobs.cmd_trials, "list a job's trials: predicted and measured",
             "  pipette trials 5601acd3\n  pipette trials 5601acd3 --sort tokens\n"
             "  pipette trials 5601acd3 --state oom --json | jq -r '.[].label'")
    p.add_argument("job", help="the job's id or its first characters")
    p.add_argument("--sort", choices=sorted(client_jobs.SORT_KEYS), default="number",
                   help="sort by this column (tokens: highest first; the others: lowest first)")
    p.add_argument("--reverse", action="store_true", help="reverse the order")
    p.add_argument("--state", action="append", choices=["running", "ok", "oom", "failed", "timeout", "pruned",
                                                        "interrupted"], help="only trials in this state (repeat)")
    _json(p)

    p = _add(sub, "best", client_jobs.cmd_best, "show the best configuration and write its launch files",
             "  pipette best 5601acd3\n  pipette best 5601acd3 -o best/ && (cd best && ./launch.sh)\n"
             "  pipette best 5601acd3 --json | jq .ds_config",
             "Show the best configuration so far; with -o, write its DeepSpeed config (ds_config.json), "
             "hostfile, rank map, candidate.json and launch command (launch.sh) into DIR.")
    p.add_argument("job", help="the job's id or its first characters")
    p.add_argument("-o", "--out", metavar="DIR", help="write the launch files here")
    _json(p)

    p = _add(sub, "cancel", client_jobs.cmd_cancel, "cancel a job",
             "  pipette cancel 5601acd3",
             "Cancel a job: a queued one at once, a running one within a step (its running trial is stopped).")
    p.add_argument("job", help="the job's id or its first characters")
    _json(p)
