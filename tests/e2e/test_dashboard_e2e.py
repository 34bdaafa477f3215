"""The dashboard in headless Chromium, on the session's real job (see conftest.py).

The checks read what was drawn (SVG marks and their data-* attributes, table rows) and compare
it with the API's own numbers for the job: a plot that renders but shows other data fails.
Screenshots go to tests/e2e/artifacts/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipette.cli.client_cluster import slow_links
from pipette.clusterfile import load_cluster
from tests.e2e.conftest import ROOT, TINY_JOB, Browser, JobRun, Service, login

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]
BAD = {"oom", "failed", "timeout"}


def marks(page: Any, selector: str, fields: str) -> list[Any]:
    """``fields`` (a JS expression of ``e``) of every element ``selector`` matches."""
    return list(page.eval_on_selector_all(selector, f"els => els.map(e => {fields})"))


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_login_refuses_a_bad_token(browser: Browser, service: Service) -> None:
    page = browser.page
    page.goto(service.url + "/#/")
    page.evaluate("sessionStorage.clear()")
    page.reload()
    page.wait_for_selector("#login")  # no token: the login page, whatever the address
    page.fill("#token", "pip_not_a_real_token")
    page.click("#login button[type=submit]")
    error = page.wait_for_selector("#login .error")
    assert "Authorization" in error.inner_text() and "fix:" in error.inner_text()
    assert page.evaluate("sessionStorage.getItem('pipette.token')") is None
    login(browser, service)
    assert page.evaluate("sessionStorage.getItem('pipette.token')") == service.token


def test_jobs_list_and_job_page_update_live(job_run: JobRun) -> None:
    # The list showed the job move on while it ran (its state, its trials), without a reload ...
    assert len(job_run.list_states) >= 2, job_run.list_states
    assert job_run.list_states[-1].split()[0] in ("running", "succeeded"), job_run.list_states
    assert job_run.list_states[-1].split()[1] in ("1/2", "2/2"), job_run.list_states
    # ... and the job page, open in another tab from the start, followed it to the end.
    assert job_run.page_states[0] in ("queued", "profiling", "planning", "running"), job_run.page_states
    assert job_run.page_states[-1] == "succeeded", job_run.page_states
    assert len(job_run.page_states) >= 2 and job_run.page_trials[-1] == 2, (job_run.page_states, job_run.page_trials)
    assert not job_run.reloaded


def _open_job(browser: Browser, service: Service, job_id: str) -> Any:
    page = browser.page
    page.goto(f"{service.url}/#/jobs/{job_id}")
    page.wait_for_selector('#main[data-job-state="succeeded"]')
    page.wait_for_selector("#best-ds")
    return page


def test_job_page_plots_show_the_jobs_real_data(browser: Browser, logged_in: Service, job_run: JobRun) -> None:
    api = logged_in.api
    job = api(f"/v1/jobs/{job_run.id}")
    trials = api(f"/v1/jobs/{job_run.id}/trials")["items"]
    plan = api(f"/v1/jobs/{job_run.id}/plan")
    detail = api(f"/v1/jobs/{job_run.id}/trials/{job['best']['trial']}")
    page = _open_job(browser, logged_in, job_run.id)

    # Convergence: one point per trial that measured a throughput, at its value; the best so far; the stop.
    points = marks(page, "#convergence circle.point", "[+e.dataset.trial, +e.dataset.value]")
    expected = [[t["number"], t["tokens_per_s"]] for t in trials if t["tokens_per_s"] and t["state"] not in BAD]
    assert sorted(points) == sorted(expected) and points
    best = max(t["tokens_per_s"] for t in trials if t["state"] == "ok")
    assert close(float(page.get_attribute("#convergence path.best-line", "data-best") or 0), best)
    assert close(best, job["best"]["tokens_per_s"])
    stop = page.text_content("#convergence .stop-marker") or ""
    assert job["stop_reason"] in stop
    assert page.locator("#convergence rect.predicted").count() == sum(1 for t in trials if t["predicted_step_time"])

    # Predicted against measured: one point per measured trial, and the model's error as drawn.
    scatter = marks(page, "#scatter circle.point", "[+e.dataset.predicted, +e.dataset.measured]")
    measured = [t for t in trials if t["predicted_step_time"] and t["measured_step_time"] and t["state"] not in BAD]
    assert sorted(scatter) == sorted([[t["predicted_step_time"], t["measured_step_time"]] for t in measured])
    ok = [t for t in trials if t["state"] == "ok"]
    mape = sum(abs(t["measured_step_time"] - t["predicted_step_time"]) / t["measured_step_time"] for t in ok) / len(ok)
    assert close(float(page.get_attribute("#scatter svg", "data-mape") or 0), mape)
    assert f"MAPE {mape * 100:.1f}%" in page.inner_text("#model-error")

    # Candidate map: every (tp, pp) of the plan and the trials, measured where a trial ran ok.
    cells = {(int(c["tp"]), int(c["pp"])): c for c in page.eval_on_selector_all(
        "#heatmap g.cell", "els => els.map(e => ({tp: e.dataset.tp, pp: e.dataset.pp, kind: e.dataset.kind, "
        "value: e.dataset.value, oom: e.classList.contains('oom-measured')}))")}
    wanted = _cells(plan, trials)
    assert set(cells) == set(wanted)
    for key, (kind, value, oom_measured) in wanted.items():
        assert cells[key]["kind"] == kind, (key, cells[key], kind)
        if value is not None:
            assert close(float(cells[key]["value"]), value), (key, cells[key], value)
        assert cells[key]["oom"] == oom_measured
    b = job["best"]["config"]
    assert cells[(b["tp"], b["pp"])]["kind"] == "measured"

    # Memory of the best configuration: the estimator's breakdown, each device's measured peak, capacity.
    record = detail["record"]
    parts = dict(marks(page, "#memory rect.mem-seg", "[e.dataset.part, +e.dataset.bytes]"))
    assert parts == {k: v for k, v in record["memory"]["breakdown"].items() if v > 0}
    bars = marks(page, "#memory rect.mem-bar", "+e.dataset.bytes")
    assert bars == record["measurement"]["peak_memory"] and len(bars) == 2
    assert int(page.get_attribute("#memory g.capacity", "data-bytes") or 0) == record["memory"]["capacity_bytes"]

    browser.screenshot("job-page.png")


def _cells(plan: dict[str, Any], trials: list[dict[str, Any]]) -> dict[tuple[int, int], tuple[str, float | None, bool]]:
    """What each tp x pp cell must show: kind, value, and whether a trial ran out of memory."""
    keys: set[tuple[int, int]] = set()
    predicted: dict[tuple[int, int], float] = {}
    oom_pred: set[tuple[int, int]] = set()
    for p in plan["ranked"]:
        k = (p["config"]["tp"], p["config"]["pp"])
        keys.add(k)
        predicted[k] = max(predicted.get(k, 0.0), p["perf"]["tokens_per_s"])
    for d in plan["out_of_memory"]:
        k = (d["config"]["tp"], d["config"]["pp"])
        keys.add(k)
        oom_pred.add(k)
    measured: dict[tuple[int, int], float] = {}
    oom: set[tuple[int, int]] = set()
    for t in trials:
        k = (t["config"]["tp"], t["config"]["pp"])
        keys.add(k)
        if t["state"] == "oom":
            oom.add(k)
        if t["state"] == "ok" and t["tokens_per_s"]:
            measured[k] = max(measured.get(k, 0.0), t["tokens_per_s"])
    out: dict[tuple[int, int], tuple[str, float | None, bool]] = {}
    for k in keys:
        if k in measured:
            out[k] = ("measured", measured[k], k in oom)
        elif k in predicted:
            out[k] = ("predicted", predicted[k], k in oom)
        elif k in oom_pred:
            out[k] = ("oom-pred", None, k in oom)
        else:
            out[k] = ("empty", None, k in oom)
    return out


def test_trials_table_sorts_and_filters(browser: Browser, logged_in: Service, job_run: JobRun) -> None:
    trials = logged_in.api(f"/v1/jobs/{job_run.id}/trials")["items"]
    page = _open_job(browser, logged_in, job_run.id)

    def numbers() -> list[int]:
        return [int(x) for x in marks(page, "#trials-table tbody tr", "e.dataset.trial")]

    assert numbers() == [t["number"] for t in trials]
    page.click('#trials-table th[data-key="tokens_per_s"]')
    by_rate = sorted((t for t in trials if t["tokens_per_s"]), key=lambda t: -t["tokens_per_s"])
    assert numbers()[: len(by_rate)] == [t["number"] for t in by_rate]
    assert page.get_attribute('#trials-table th[data-key="tokens_per_s"]', "aria-sort") == "descending"
    page.click('#trials-table th[data-key="tokens_per_s"]')
    assert numbers()[: len(by_rate)] == [t["number"] for t in reversed(by_rate)]
    page.click('#trials-table th[data-key="measured_step_time"]')
    by_time = sorted((t for t in trials if t["measured_step_time"]), key=lambda t: t["measured_step_time"])
    assert numbers()[: len(by_time)] == [t["number"] for t in by_time]

    page.select_option("#trial-state", "ok")
    assert numbers() == [t["number"] for t in by_time if t["state"] == "ok"]
    page.select_option("#trial-state", "")
    label = trials[-1]["label"]
    page.fill("#trial-filter", label)
    assert numbers() == [t["number"] for t in trials if label in t["label"]]
    assert page.inner_text("#trial-count").startswith(f"{len(numbers())} of {len(trials)}")
    page.fill("#trial-filter", "")


def test_best_config_copy_and_download(browser: Browser, logged_in: Service, job_run: JobRun, tmp_path: Path) -> None:
    best = logged_in.api(f"/v1/jobs/{job_run.id}/best")
    page = _open_job(browser, logged_in, job_run.id)
    assert page.inner_text("#best-label") == best["trial"]["label"]
    assert json.loads(page.inner_text("#best-ds")) == best["ds_config"]
    assert page.inner_text("#best-launch").strip() == best["launch_command"].strip()

    page.click("#copy-ds")
    assert json.loads(page.evaluate("navigator.clipboard.readText()")) == best["ds_config"]
    page.click("#copy-launch")
    assert page.evaluate("navigator.clipboard.readText()") == best["launch_command"]

    cli_out = tmp_path / "cli"
    assert logged_in.cli("best", job_run.id, "-o", str(cli_out)).returncode == 0
    for name in ("ds_config.json", "hostfile", "launch.sh"):
        with page.expect_download() as info:
            page.click(f'button.download[data-file="{name}"]')
        download = info.value
        assert download.suggested_filename == name
        saved = tmp_path / name
        download.save_as(saved)
        assert saved.read_text() == (cli_out / name).read_text(), name
    assert json.loads((tmp_path / "ds_config.json").read_text()) == best["ds_config"]


def test_cluster_page_links_memory_compute(browser: Browser, logged_in: Service, job_run: JobRun) -> None:
    cluster = logged_in.api("/v1/clusters/local")
    profile = cluster["latest_profile"]["profile"]
    n = len(profile["devices"])
    page = browser.page
    page.goto(f"{logged_in.url}/#/clusters")
    page.click(f'tr[data-cluster-id="{cluster["id"]}"] a')
    page.wait_for_selector("#links svg")
    cells = marks(page, "#links g.link-cell", "[+e.dataset.i, +e.dataset.j, +e.dataset.bw]")
    assert len(cells) == n * (n - 1)
    for i, j, bw in cells:
        assert close(bw, profile["links"]["bandwidth"][i][j])
    slow = {tuple(sorted(c)) for c in marks(page, "#links g.link-cell.slow", "[+e.dataset.i, +e.dataset.j]")}
    assert slow == {(i, j) for i, j, _, _ in slow_links(profile)}
    memory = marks(page, "#device-memory rect.bar", "[e.classList[1], +e.dataset.value]")
    devices = profile["devices"]
    assert sorted(v for c, v in memory if c == "memory-total") == sorted(d["spec"]["memory_bytes"] for d in devices)
    assert sorted(v for c, v in memory if c == "memory-free") == sorted(d["free_memory"] for d in devices)
    fp32 = marks(page, "#device-compute rect.bar.compute-fp32", "+e.dataset.value")
    assert sorted(fp32) == sorted(d["spec"]["peak_flops"]["fp32"] for d in profile["devices"])
    assert "Measured" in page.inner_text("#measured-at")
    browser.screenshot("cluster-page.png")


def test_link_matrix_marks_slow_links_like_the_cli(browser: Browser, logged_in: Service) -> None:
    """The cluster here has 2 devices and no slow link: draw the slow-links example cluster
    (32 H100s, links 2.5-4x slower across racks) with the page's own code and compare."""
    profile = load_cluster(ROOT / "examples" / "clusters" / "h100-4x8-slow-links.yaml").to_dict()
    page = browser.page
    page.goto(f"{logged_in.url}/#/clusters")
    page.wait_for_selector("#clusters")
    drawn = page.evaluate("""async (profile) => {
        const charts = await import('/dashboard/charts.js');
        const m = charts.linkMatrix(profile);
        const main = document.getElementById('main');
        const title = 'Link matrix of examples/clusters/h100-4x8-slow-links.yaml';
        main.replaceChildren(charts.h('h1', {text: title}), m.svg);
        return [...m.svg.querySelectorAll('g.link-cell.slow')].map(g => [+g.dataset.i, +g.dataset.j]);
    }""", profile)
    expected = {(i, j) for i, j, _, _ in slow_links(profile)}
    assert expected, "the example must have slow links"
    assert {tuple(sorted(p)) for p in drawn} == expected
    browser.screenshot("link-matrix-slow-links.png")


def test_nothing_loaded_from_elsewhere_and_no_script_errors(browser: Browser, service: Service) -> None:
    page = browser.page
    page.goto(service.url + "/")
    page.wait_for_selector("#jobs")
    outside = [u for u in browser.requests if not u.startswith((service.url, "data:", "blob:"))]
    assert outside == []
    uncaught = [e for e in browser.errors if "Failed to load resource" not in e]
    assert uncaught == []
    csp = page.evaluate("fetch('/').then(r => r.headers.get('content-security-policy'))")
    assert "default-src 'self'" in csp


def test_a_job_no_scheduler_serves_says_why_and_cancels_from_the_page(
        browser: Browser, logged_in: Service, tmp_path: Path) -> None:
    """A job on a Ray cluster this service's scheduler does not drive stays queued: its page
    says why and what to start, and its Cancel button (after the confirm dialog) ends it."""
    added = logged_in.cli("cluster", "add", "unserved", "--ray", "10.255.255.2:6380", "--devices", "2")
    assert added.returncode == 0, added.stderr
    job_file = tmp_path / "unserved.yaml"
    job_file.write_text(TINY_JOB.replace("cluster: local", "cluster: unserved"))
    job_id = json.loads(logged_in.cli("submit", str(job_file), "--json").stdout)["id"]
    login(browser, logged_in)
    page = browser.page
    page.click(f'tr[data-job-id="{job_id}"] a')
    notice = page.wait_for_selector("#job-notice").inner_text()
    assert "no scheduler serves" in notice and "ray:10.255.255.2" in notice, notice
    assert "RAY_ADDRESS" in notice and "pipette-admin worker" in notice, notice
    assert page.get_attribute("#main", "data-job-state") == "queued"
    browser.screenshot("job-unserved.png")

    page.once("dialog", lambda d: d.accept())
    page.click("#cancel")
    page.wait_for_selector('#main[data-job-state="cancelled"]')  # the page follows, no reload
    assert page.locator("#job-notice").count() == 0
    assert logged_in.api(f"/v1/jobs/{job_id}")["state"] == "cancelled"
