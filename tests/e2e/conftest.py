"""The end-to-end fixtures: Pipette as a person runs it.

A real service (``pipette serve`` in a subprocess: SQLite in a temporary ``PIPETTE_HOME``, its
scheduler, a local Ray it starts on ports of its own), a token made with the admin command,
the CLI run as subprocesses, and the dashboard in Debian's headless Chromium driven by
Playwright. One tiny job (2 trials of tiny-llama on 2 CPU devices) runs for the whole session
and every test that needs a finished job reads that one: the machine has 2 shared cores.

Nothing here skips: without Chromium or Playwright the browser tests fail and say how to
install them (``.ci/run`` installs Chromium; ``./dev install`` installs Playwright).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PIPETTE_E2E_ARTIFACTS") or ROOT / "tests" / "e2e" / "artifacts")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
#: The job every browser and CLI test reads: 2 trials, 3 timed steps each, 2 CPU devices.
#: ZeRO 0-1 only and no retry: ZeRO-3 trials take minutes on 2 busy cores, and the suite must
#: stay short (the service's own tests run every stage).
TINY_JOB = """\
name: e2e tiny job
cluster: local
model: tiny-llama
training: {global_batch: 4, seq_len: 32, dtype: fp32, method: lora, lora: {rank: 8, alpha: 16}, zero_stages: [0, 1]}
budget: {max_trials: 2, steps: 3, retries: 0}
"""
JOB_TIMEOUT_S = 1200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    url: str
    home: Path
    env: dict[str, str]
    log: Path
    token: str = ""

    def cli(self, *args: str, env: dict[str, str] | None = None, stdin: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``pipette ARGS`` as a person would (a subprocess, the service's env)."""
        return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, input=stdin, timeout=timeout, cwd=ROOT)

    def api(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    home = tmp_path_factory.mktemp("pipette-home")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPETTE_", "RAY_"))}
    env.update({
        "PIPETTE_HOME": str(home), "PIPETTE_URL": f"http://127.0.0.1:{port}",
        "PIPETTE_CONFIG": str(home / "client" / "config.json"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PIPETTE_POLL_S": "0.5", "NO_COLOR": "1",
    })
    log = home / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    svc = Service(f"http://127.0.0.1:{port}", home, env, log)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"pipette serve exited with {proc.returncode}:\n{svc.log_tail()}", pytrace=False)
            try:
                with urllib.request.urlopen(svc.url + "/healthz", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"pipette serve did not answer in 180 s:\n{svc.log_tail()}", pytrace=False)
                time.sleep(0.5)
        # The admin command, as an operator runs it: the token is printed once on stdout.
        made = subprocess.run([sys.executable, "-m", "service.admin", "token", "create", "--tenant", "e2e"],
                              capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
        assert made.returncode == 0, made.stderr
        svc.token = made.stdout.strip()
        yield svc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the service stops its scheduler and Ray), then SIGKILL of its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: Ray's processes it started, nothing else
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def logged_in(service: Service) -> Service:
    """``pipette login`` with the admin's token: the config file the other commands read."""
    r = service.cli("login", "--with-token", stdin=service.token + "\n")
    assert r.returncode == 0, r.stderr
    return service


@pytest.fixture(scope="session")
def cluster(logged_in: Service) -> dict[str, Any]:
    """``cluster add`` then ``cluster profile --wait``: the real probe of this machine as 2 CPU
    devices (the job then plans on this profile instead of measuring again)."""
    r = logged_in.cli("cluster", "add", "local", "--devices", "2", "--json")
    assert r.returncode == 0, r.stderr
    added = dict(json.loads(r.stdout))
    measured = logged_in.cli("cluster", "profile", "local", "--wait", "--timeout", "600", "--json", timeout=660)
    assert measured.returncode == 0, measured.stderr + logged_in.log_tail()
    added["profiled"] = json.loads(measured.stdout)
    return added


# ---- the browser -------------------------------------------------------------------------

@dataclass
class Browser:
    context: Any
    page: Any
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def watch_errors(self, page: Any) -> None:
        """Collect ``page``'s uncaught script errors and console errors into ``errors``."""
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture(scope="session")
def browser(service: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(exe).exists():
        pytest.fail("Chromium is not installed: `apt-get install -y chromium` (.ci/run does it)", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: `./dev install` (it is in the dev extra)", pytrace=False)
    pw = sync_playwright().start()
    context = pw.chromium.launch_persistent_context(
        str(tmp_path_factory.mktemp("chromium-profile")), executable_path=exe, headless=True, args=CHROMIUM_FLAGS,
        accept_downloads=True, viewport={"width": 1400, "height": 1000},
    )
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=service.url)
    context.set_default_timeout(30_000)
    page = context.pages[0] if context.pages else context.new_page()
    b = Browser(context, page)
    context.on("request", lambda r: b.requests.append(r.url))
    b.watch_errors(page)
    try:
        yield b
    finally:
        context.close()
        pw.stop()


def login(browser: Browser, service: Service, page: Any = None) -> None:
    page = page or browser.page
    page.goto(service.url + "/#/login")
    page.fill("#token", service.token)
    page.click("#login button[type=submit]")
    page.wait_for_selector("#jobs")


# ---- the one real job ----------------------------------------------------------------------

@dataclass
class JobRun:
    """What the session's job did, as the CLI and the browser saw it while it ran."""

    id: str
    watch_code: int
    watch_output: str
    cancelled_id: str
    cancel_output: str
    list_states: list[str]  # "state done/max" of the job in the jobs list, as it changed (no reload)
    page_states: list[str]  # the job page's state, as it changed
    page_trials: list[int]  # the job page's trial count, as it changed
    reloaded: bool


@pytest.fixture(scope="session")
def job_run(logged_in: Service, cluster: dict[str, Any], browser: Browser, tmp_path_factory: pytest.TempPathFactory,
            ) -> JobRun:
    """Submit the tiny job with ``pipette submit --watch`` while the dashboard is open, queue a
    second job behind it and cancel that with the CLI, and record what the browser showed
    live, without ever reloading either page.

    The jobs list and the job page are two tabs, both open while the job runs: one tab that
    went from the list to the job page could open it after the job had ended (it did, in CI,
    when the second trial was quick)."""
    svc, page = logged_in, browser.page
    job_file = tmp_path_factory.mktemp("jobs") / "tiny.yaml"
    job_file.write_text(TINY_JOB)
    login(browser, svc)
    page.evaluate("window.__pipetteNoReload = true")

    # The job page's tab, logged in before the job starts (as a person would have it open).
    job_tab = browser.context.new_page()
    browser.watch_errors(job_tab)
    login(browser, svc, job_tab)
    job_tab.evaluate("window.__pipetteNoReload = true")

    proc = subprocess.Popen([sys.executable, "-m", "cli", "submit", str(job_file), "--watch"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=svc.env, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        job_id = _wait_for_id(lines, proc)
        row = f'tr[data-job-id="{job_id}"]'
        page.wait_for_selector(row, timeout=30_000)  # the list polls: no reload

        job_tab.click(f"{row} a")  # its list polls too
        job_tab.wait_for_selector("#main[data-job-state]")

        def seen() -> str:
            return f"{page.get_attribute(row, 'data-state')} {page.text_content(f'{row} .trials-count')}"

        list_states = [seen()]
        page_states: list[str] = []
        page_trials: list[int] = []

        def follow_job_page() -> bool:
            """Record the job page's state and trial count; True once the job has ended."""
            state = job_tab.get_attribute("#main", "data-job-state") or ""
            trials = int(job_tab.get_attribute("#main", "data-trials") or 0)
            if not page_states or state != page_states[-1]:
                page_states.append(state)
            if not page_trials or trials != page_trials[-1]:
                page_trials.append(trials)
            return state in ("succeeded", "failed", "cancelled")

        follow_job_page()
        second = svc.cli("submit", str(job_file), "--name", "to cancel", "--json")
        assert second.returncode == 0, second.stderr
        cancelled_id = json.loads(second.stdout)["id"]
        cancel = svc.cli("cancel", cancelled_id[:8])
        page.wait_for_selector(f'tr[data-job-id="{cancelled_id}"][data-state="cancelled"]', timeout=30_000)

        # Watch both tabs until the job has ended; the list must have shown it move on too.
        shot = False
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            now = seen()
            if now != list_states[-1]:
                list_states.append(now)
            if not shot and now.startswith("running") and now.endswith(("1/2", "2/2")):
                browser.screenshot("jobs-list.png")  # while the job runs (and the cancelled one below it)
                shot = True
            if follow_job_page():
                break
            time.sleep(0.3)
        reloaded = not all(p.evaluate("window.__pipetteNoReload === true") for p in (page, job_tab))
        code = proc.wait(timeout=max(deadline - time.monotonic(), 30))
        # The list's own poll may lag the job page by one period: give it that long to catch up.
        catch_up = time.monotonic() + 15
        while time.monotonic() < catch_up and seen() == list_states[-1] and not list_states[-1].endswith("2/2"):
            time.sleep(0.3)
        if seen() != list_states[-1]:
            list_states.append(seen())
        if not shot:
            browser.screenshot("jobs-list.png")
    finally:
        job_tab.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    output = "".join(lines)
    assert page_states and page_states[-1] == "succeeded", (
        f"the job did not succeed: {page_states}\nwatch:\n{output}\nservice:\n{svc.log_tail()}")
    return JobRun(job_id, code, output, cancelled_id, cancel.stdout + cancel.stderr, list_states, page_states,
                  page_trials, reloaded)


def _wait_for_id(lines: list[str], proc: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in lines:
            if line.startswith("submitted job "):
                return line.split()[2]
        if proc.poll() is not None and not any(line.startswith("submitted job ") for line in lines):
            pytest.fail(f"pipette submit --watch exited {proc.returncode}:\n{''.join(lines)}", pytrace=False)
        time.sleep(0.2)
    pytest.fail(f"pipette submit printed no job id:\n{''.join(lines)}", pytrace=False)
