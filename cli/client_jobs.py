"""``pipette submit | jobs | status | trials | best | cancel``: jobs through the REST API."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from cli import client_output as out
from cli.client_api import EXIT_OK, ApiError, Client, client, resolve_job
from cli.client_jobfile import load_job_file
from cli.inputs import option_values
from pipette.result_text import degrees

#: ``trials --sort`` keys -> the trial field (None sorts last either way)
SORT_KEYS = {
    "number": "number", "state": "state", "predicted": "predicted_step_time", "measured": "measured_step_time",
    "tokens": "tokens_per_s", "error": "prediction_error", "peak": "peak_memory_bytes", "duration": "duration_s",
}


# ---- submit ---------------------------------------------------------------------------

def cmd_submit(args: argparse.Namespace) -> int:
    body = load_job_file(args.file, args.set or ())
    if args.name:
        body["name"] = args.name
    given = option_values(args, "tune", given_only=True)
    if given and isinstance(body.get("budget", {}), dict):  # else the service names the file's budget
        body["budget"] = {**body.get("budget", {}), **given}
    api = client()
    check_body_size(api, body)
    accepted = api.post("/v1/jobs", body)
    if args.json and not args.watch:
        out.print_json(accepted)
        return EXIT_OK
    print(f"submitted job {out.bold(accepted['id'])} ({out.state(accepted['state'])})")
    print(f"  status: pipette status {out.short_id(accepted['id'])}    dashboard: {api.url}/#/jobs/{accepted['id']}")
    if not args.watch:
        print(f"  follow: pipette watch {out.short_id(accepted['id'])}")
        return EXIT_OK
    from cli.client_watch import watch

    sys.stdout.flush()
    return watch(api, accepted["id"], as_json=args.json)


def check_body_size(api: Client, body: dict[str, Any]) -> None:
    """Refuse, before sending, a job whose body is over the service's request limit: a script's
    working folder travels zipped and base64-encoded in it, and a body over the limit was sent
    whole only to be answered 413 (or, over 16 MiB, a connection reset)."""
    script = body.get("script")
    if not isinstance(script, dict) or not script.get("files"):
        return
    size = len(json.dumps(body).encode())  # as Client._open encodes it
    limits = api.get("/v1/limits")
    limit = int(limits["max_body_bytes"])
    if size <= limit:
        return
    encoded = len(str(script["files"]))
    fits = max(0, limit - (size - encoded)) * 3 // 4  # the zip that would fit beside the rest of the job
    raise ApiError(f"the job is {size:,} bytes to send, more than the service's request limit of {limit:,} bytes: "
                   f"its working folder is {out.size(encoded * 3 // 4)} zipped, sent as base64; up to about "
                   f"{out.size(fits)} zipped fits", field="script.workdir",
                   fix="leave data, checkpoints and environments out of the working folder (the script can read "
                       f"them from a path on the nodes), or ask the service's operator to raise {limits['setting']}")


# ---- jobs -----------------------------------------------------------------------------

def cmd_jobs(args: argparse.Namespace) -> int:
    api = client()
    query: dict[str, Any] = {"state": args.state or None, "cluster": args.cluster, "limit": min(args.limit, 200)}
    items: list[dict[str, Any]] = []
    while len(items) < args.limit:
        page = api.get("/v1/jobs", query)
        items += page["items"]
        if not page.get("next_cursor"):
            break
        query["cursor"] = page["next_cursor"]
    items = items[: args.limit]
    if args.json:
        out.print_json(items)
        return EXIT_OK
    if not items:
        print("no jobs yet: submit one with `pipette submit examples/jobs/tiny-cpu.yaml`")
        return EXIT_OK
    names = _cluster_names(api)
    rows = []
    for j in items:
        p = j["progress"]
        best = j.get("best") or {}
        rows.append([
            out.short_id(j["id"]), j["name"] or "-", out.state(j["state"]), j["model"].get("name", "?"),
            names.get(j["cluster_id"], out.short_id(j["cluster_id"])),
            f"{p['trials_done']}/{p['max_trials']}", out.rate(best.get("tokens_per_s")),
            best.get("label") or "-", out.age(j.get("started_at")),
        ])
    print(out.table(["ID", "NAME", "STATE", "MODEL", "CLUSTER", "TRIALS", "BEST TOK/S", "BEST CONFIG", "STARTED"],
                    rows, right=(5, 6)))
    return EXIT_OK


def _cluster_names(api: Client) -> dict[str, str]:
    return {c["id"]: c["name"] for c in api.get("/v1/clusters")["items"]}


# ---- status ---------------------------------------------------------------------------

def cmd_status(args: argparse.Namespace) -> int:
    api = client()
    job = api.get(f"/v1/jobs/{resolve_job(api, args.job)}")
    if args.json:
        out.print_json(job)
        return EXIT_OK
    print(status_text(job, _cluster_names(api)))
    return EXIT_OK


def status_text(job: dict[str, Any], cluster_names: dict[str, str]) -> str:
    p, t = job["progress"], job["training"]
    lines = [
        f"job      {job['id']}{'  ' + repr(job['name']) if job['name'] else ''}",
        f"state    {out.state(job['state'])}" + ("  (cancel requested)" if job["cancel_requested"]
                                                  and job["state"] not in ("cancelled",) else ""),
        f"model    {job['model'].get('name', '?')}, {t.get('method')}, {t.get('dtype')}, global batch "
        f"{t.get('global_batch')} x {t.get('seq_len')} tokens",
        f"cluster  {cluster_names.get(job['cluster_id'], job['cluster_id'])}",
        f"trials   {out.bar(p['trials_done'], p['max_trials'])} {p['trials_done']}/{p['max_trials']} done, "
        f"{p['trials_ok']} ok" + (f", trial {p['running_trial']} running" if p.get("running_trial") is not None
                                   else "") + f"; {out.seconds(p.get('tuning_s'))} of trials",
        f"created  {job['created_at']}  started {job.get('started_at') or '-'}  "
        f"finished {job.get('finished_at') or '-'}",
    ]
    best = job.get("best")
    if best:
        pred = best.get("predicted_step_time")
        lines.append(f"best     trial {best['trial']}  {best['label']}  {out.seconds(best.get('measured_step_time'))}"
                     f"/step  {out.rate(best.get('tokens_per_s'))} tokens/s  (predicted {out.seconds(pred)})")
    if job.get("notice"):
        lines.append(f"waiting  {job['notice']}")
    waiting = (job.get("progress") or {}).get("waiting_for_nodes")
    if waiting:
        lines.append(f"waiting  for lost Ray node(s): {', '.join(waiting)}")
    if job.get("stop_reason"):
        lines.append(f"stopped  {job['stop_reason']}")
    err = job.get("error")
    if err:
        field = f"{err['field']}: " if err.get("field") else ""
        fix = f" (fix: {err['fix']})" if err.get("fix") else ""
        lines.append(f"error    {field}{err['message']}{fix}")
    return "\n".join(lines)


# ---- trials ---------------------------------------------------------------------------

def cmd_trials(args: argparse.Namespace) -> int:
    api = client()
    items = api.get(f"/v1/jobs/{resolve_job(api, args.job)}/trials")["items"]
    if args.state:
        items = [t for t in items if t["state"] in args.state]
    items = sort_trials(items, args.sort, args.reverse)
    if args.json:
        out.print_json(items)
        return EXIT_OK
    if not items:
        print("no trials yet" + (" in that state" if args.state else ""))
        return EXIT_OK
    rows = []
    for t in items:
        error = (t.get("error") or "").splitlines()[0] if t.get("error") else ""
        rows.append([
            str(t["number"]), out.state(t["state"]), t["label"], out.seconds(t.get("predicted_step_time")),
            out.seconds(t.get("measured_step_time")), out.rate(t.get("tokens_per_s")),
            out.percent(t.get("prediction_error")), out.size(t.get("peak_memory_bytes")),
            out.seconds(t.get("duration_s")), error[:60] + ("..." if len(error) > 60 else ""),
        ])
    print(out.table(["#", "STATE", "CONFIG", "PREDICTED", "MEASURED", "TOK/S", "ERROR %", "PEAK MEM", "DURATION",
                     "ERROR"], rows, right=(0, 3, 4, 5, 6, 7, 8)))
    return EXIT_OK


def sort_trials(items: list[dict[str, Any]], key: str, reverse: bool) -> list[dict[str, Any]]:
    """Sorted by ``key`` (see ``SORT_KEYS``); trials without a value go last either way.
    Throughput sorts best (highest) first by default, the others lowest first."""
    field = SORT_KEYS[key]
    have = [t for t in items if t.get(field) is not None]
    missing = [t for t in items if t.get(field) is None]
    descending = (key == "tokens") != reverse
    return sorted(have, key=lambda t: (t[field], t["number"]), reverse=descending) + missing


# ---- best -----------------------------------------------------------------------------

def cmd_best(args: argparse.Namespace) -> int:
    api = client()
    job_id = resolve_job(api, args.job)
    best = api.get(f"/v1/jobs/{job_id}/best")
    written: dict[str, str] = {}
    if args.out:
        folder = Path(args.out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, url in best["files"].items():
                path = folder / name
                path.write_text(api.get_text(url))
                if name.endswith(".sh"):
                    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                written[name] = str(path)
        except OSError as e:
            raise ApiError(f"cannot write {args.out!r} ({e.strerror})", field="--out",
                           fix="give a folder you can write to") from None
    if args.json:
        out.print_json({**best, "written": written})
        return EXIT_OK
    t = best["trial"]
    c = best["config"]
    print(f"best of job {job_id}: trial {t['number']}  {out.bold(t['label'])}")
    layout = "  ".join(f"{k} {v}" for k, v in degrees(c))  # cp and ep only when not 1
    print(f"  {layout}  micro-batch {c['mbs']}  grad accum {c['grad_accum']}  "
          f"ZeRO {c['zero_stage']}  recompute {c['recompute']}  schedule {c['schedule']}")
    print(f"  measured {out.seconds(t.get('measured_step_time'))}/step, {out.rate(t.get('tokens_per_s'))} tokens/s; "
          f"predicted {out.seconds(t.get('predicted_step_time'))}; peak memory {out.size(t.get('peak_memory_bytes'))}")
    print(f"  placement (rank -> device): {c.get('placement')}")
    if written:
        print(f"\nwrote {', '.join(sorted(written))} to {args.out}{os.sep}")
        launches = sorted(n for n in written if n.startswith("launch-"))  # a script's launchers
        if "launch.sh" in written:
            print(f"launch: (cd {args.out} && ./launch.sh)")
        elif launches:
            print(f"launch: {' or '.join(f'{args.out}{os.sep}{n}' for n in launches)}")
        else:
            print(f"launch: {best['launch_command']}")
    else:
        print("\nlaunch command:\n  " + best["launch_command"])
        print("(write the files with -o DIR)")
    return EXIT_OK


# ---- cancel ---------------------------------------------------------------------------

def cmd_cancel(args: argparse.Namespace) -> int:
    api = client()
    job = api.post(f"/v1/jobs/{resolve_job(api, args.job)}/cancel")
    if args.json:
        out.print_json(job)
        return EXIT_OK
    if job["state"] == "cancelled":
        print(f"job {job['id']} {out.state('cancelled')}")
    else:
        print(f"job {job['id']}: cancel requested; it is {out.state(job['state'])} and stops within a step "
              f"(follow: pipette watch {out.short_id(job['id'])})")
    return EXIT_OK
