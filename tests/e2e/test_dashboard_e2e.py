"""The dashboard in headless Chromium, on the session's real job (see conftest.py).

The checks read what was drawn (SVG marks and their data-* attributes, table rows) and compare
it with the API's own numbers for the job: a plot that renders but shows other data fails.
Where the job cannot show a case (12 trials, a pruned one), the page's own chart code draws
data shaped like a CPU job's, and the checks measure what Chromium laid out (getBBox).
Screenshots go to tests/e2e/artifacts/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cli.client_cluster import slow_links
from pipette.clusterfile import load_cluster
from tests.e2e.conftest import ROOT, TINY_JOB, Browser, JobRun, Service, login

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]
BAD = {"oom", "failed", "timeout"}


def marks(page: Any, selector: str, fields: str) -> list[Any]:
    """``fields`` (a JS expression of ``e``) of every element ``selector`` matches."""
    return list(page.eval_on_selector_all(selector, f"els => els.map(e => {fields})"))


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def boxes(page: Any, selector: str) -> list[dict[str, Any]]:
    """The drawn box (getBBox, in the SVG's units) and text of every element ``selector`` matches."""
    return marks(page, selector, "(b => ({x: b.x, y: b.y, w: b.width, h: b.height, text: e.textContent, "
                                 "data: {...e.dataset}}))(e.getBBox())")


def overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def plot_area(page: Any, chart: str) -> dict[str, float]:
    """The plot's frame in ``chart`` (a selector of its <svg>): the ends of its axis lines."""
    lines = marks(page, f"{chart} g.axis > line", "['x1', 'x2', 'y1', 'y2'].map(k => +e.getAttribute(k))")
    x_axis = next(a for a in lines if a[2] == a[3])
    y_axis = next(a for a in lines if a[0] == a[1])
    return {"left": x_axis[0], "right": x_axis[1], "top": y_axis[2], "bottom": x_axis[2]}


def rate(v: float) -> str:
    """The dashboard's (and the CLI's) short tokens/s."""
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:.0f}"


def prediction_error(t: dict[str, Any]) -> float:
    """The one convention (the API's prediction_error, the CLI's ERROR %): (measured - predicted) / predicted."""
    return float((t["measured_step_time"] - t["predicted_step_time"]) / t["predicted_step_time"])


def draw(browser: Browser, service: Service, chart: str, *args: Any) -> Any:
    """Draw ``charts[chart](*args)`` with the dashboard's own code, alone on a page, and return the page."""
    login(browser, service)
    page = browser.page
    page.goto(f"{service.url}/#/figure")  # no such page: nothing polls and redraws
    page.wait_for_selector("text=No such page")
    page.evaluate("""async ([chart, args]) => {
        const charts = await import('/dashboard/charts.js');
        const drawn = charts[chart](...args);
        document.getElementById('main').replaceChildren(drawn.svg || drawn);
    }""", [chart, list(args)])
    return page


def cpu_trials(n: int) -> list[dict[str, Any]]:
    """``n`` trials as a CPU job has them: measured near 5k tokens/s, predicted at 25-31k (128 tokens a step)."""
    trials = []
    for i in range(n):
        tokens = 4200.0 + 100 * (i % 7)
        oom = i == 3
        trials.append({
            "number": i, "label": f"tp1-pp1-dp2-mbs1-z{i % 2}-rc:none-1f1b-{i}", "state": "oom" if oom else "ok",
            "config": {"tp": 1, "pp": 1}, "predicted_step_time": 128 / (25_000 + 500 * i),
            "measured_step_time": None if oom else 128 / tokens, "tokens_per_s": None if oom else tokens,
            "error": "out of memory" if oom else None,
        })
    return trials


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
    mape = sum(abs(prediction_error(t)) for t in ok) / len(ok)
    assert close(float(page.get_attribute("#scatter svg", "data-mape") or 0), mape)
    assert f"MAPE {mape * 100:.1f}%" in page.inner_text("#model-error")

    # Candidate map: every (tp, pp) of the plan and the trials, measured where a trial ran ok.
    cells = {(int(c["tp"]), int(c["pp"])): c for c in page.eval_on_selector_all(
        "#heatmap g.cell", "els => els.map(e => ({tp: e.dataset.tp, pp: e.dataset.pp, kind: e.dataset.kind, "
        "value: e.dataset.value, oom: e.classList.contains('oom-measured')}))")}
    wanted = _cells(plan, trials, job["training"]["global_batch"] * job["training"]["seq_len"])
    assert set(cells) == set(wanted)
    for key, (kind, value, oom_measured) in wanted.items():
        assert cells[key]["kind"] == kind, (key, cells[key], kind)
        if value is not None:
            assert close(float(cells[key]["value"]), value), (key, cells[key], value)
        assert cells[key]["oom"] == oom_measured
    b = job["best"]["config"]
    assert cells[(b["tp"], b["pp"])]["kind"] == "measured"

    # Memory of the best configuration: the estimator's tensors, each device's measured peak, capacity.
    record = detail["record"]
    parts = dict(marks(page, "#memory rect.mem-seg", "[e.dataset.part, +e.dataset.bytes]"))
    assert parts == {k: v for k, v in record["memory"]["breakdown"].items() if v > 0 and k != "overhead"}
    bars = marks(page, "#memory rect.mem-bar", "+e.dataset.bytes")
    assert bars == record["measurement"]["peak_memory"] and len(bars) == 2
    assert int(page.get_attribute("#memory g.capacity", "data-bytes") or 0) == record["memory"]["capacity_bytes"]

    browser.screenshot("job-page.png")


def _cells(plan: dict[str, Any], trials: list[dict[str, Any]], tokens_per_step: int,
           ) -> dict[tuple[int, int], tuple[str, float | None, bool]]:
    """What each tp x pp cell must show: kind, value, and whether a trial ran out of memory.
    Measured where an ok trial measured it, else the learned prediction its trials ran with;
    never the plan's analytic estimate (a cell no trial tried shows no figure)."""
    keys: set[tuple[int, int]] = set()
    candidates: set[tuple[int, int]] = set()
    oom_pred: set[tuple[int, int]] = set()
    for p in plan["ranked"]:
        k = (p["config"]["tp"], p["config"]["pp"])
        keys.add(k)
        candidates.add(k)
    for d in plan["out_of_memory"]:
        k = (d["config"]["tp"], d["config"]["pp"])
        keys.add(k)
        oom_pred.add(k)
    measured: dict[tuple[int, int], float] = {}
    learned: dict[tuple[int, int], float] = {}
    tried: set[tuple[int, int]] = set()
    oom: set[tuple[int, int]] = set()
    for t in trials:
        k = (t["config"]["tp"], t["config"]["pp"])
        keys.add(k)
        tried.add(k)
        if t["state"] == "oom":
            oom.add(k)
        if t["state"] == "ok" and t["tokens_per_s"]:
            measured[k] = max(measured.get(k, 0.0), t["tokens_per_s"])
        if t["predicted_step_time"]:
            learned[k] = max(learned.get(k, 0.0), tokens_per_step / t["predicted_step_time"])
    out: dict[tuple[int, int], tuple[str, float | None, bool]] = {}
    for k in keys:
        if k in measured:
            out[k] = ("measured", measured[k], k in oom)
        elif k in learned:
            out[k] = ("learned", learned[k], k in oom)
        elif k in tried:
            out[k] = ("no-result", None, k in oom)
        elif k in candidates:
            out[k] = ("untried", None, k in oom)
        elif k in oom_pred:
            out[k] = ("oom-pred", None, k in oom)
        else:
            out[k] = ("empty", None, k in oom)
    return out


# ---- the figures drawn right (issue 17, item 21) ---------------------------------------------

def test_convergence_labels_above_the_scale_do_not_overlap(browser: Browser, logged_in: Service) -> None:
    """On CPUs the predictions run far above the measurements: pinned to the top edge, their
    labels must not overlap each other or the stop marker, and every such prediction is named."""
    trials = cpu_trials(12)
    page = draw(browser, logged_in, "convergence", trials,
                {"tokensPerStep": 128, "final": True, "stopReason": "budget", "maxTrials": 50})
    clipped = {int(x) for x in marks(page, "svg rect.predicted.clipped", "e.dataset.trial")}
    assert clipped == {t["number"] for t in trials}
    labels = [b for b in boxes(page, "svg text") if b["text"].startswith("pred ")]
    assert labels
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            assert not overlaps(a, b), (a, b)
    stop = boxes(page, "svg .stop-marker text")[0]
    assert not any(overlaps(label, stop) for label in labels), (labels, stop)
    named = [int(n) for label in labels for n in label["data"].get("trials", "").split()]
    assert sorted(named) == sorted(clipped)  # each once
    width = float(page.get_attribute("svg.convergence", "width") or 0)
    assert all(0 <= b["x"] and b["x"] + b["w"] <= width for b in labels)
    browser.screenshot("convergence-cpu-12-trials.png")


def test_convergence_axis_spans_the_trials_that_ran(browser: Browser, logged_in: Service) -> None:
    """12 trials of 50 allowed: the x axis covers trials 0-11 and a little room, not 0-49."""
    trials = cpu_trials(12)
    page = draw(browser, logged_in, "convergence", trials,
                {"tokensPerStep": 128, "final": True, "stopReason": "budget", "maxTrials": 50})
    area = plot_area(page, "svg.convergence")
    x_ticks = [float(b["text"]) for b in boxes(page, "svg.convergence g.axis text:not(.title)")
               if b["y"] > area["bottom"]]
    assert x_ticks and max(x_ticks) <= 12, x_ticks
    last = max(float(x) for x in marks(page, "svg.convergence circle.point", "+e.getAttribute('cx')"))
    assert last >= area["left"] + 0.85 * (area["right"] - area["left"]), (last, area)
    stop = float(page.eval_on_selector("svg .stop-marker line", "e => +e.getAttribute('x1')"))
    assert last < stop <= area["right"]


def test_scatter_band_stays_inside_the_plot(browser: Browser, logged_in: Service, job_run: JobRun) -> None:
    """The +-25% band is cut at the plot's edges: it neither runs below the x axis nor covers a tick label."""
    page = _open_job(browser, logged_in, job_run.id)
    area = plot_area(page, "#scatter svg")
    band = boxes(page, "#scatter polygon.band")[0]
    eps = 0.01
    assert band["x"] >= area["left"] - eps and band["x"] + band["w"] <= area["right"] + eps, (band, area)
    assert band["y"] >= area["top"] - eps and band["y"] + band["h"] <= area["bottom"] + eps, (band, area)
    ticks = boxes(page, "#scatter g.axis text:not(.title)")
    assert ticks and not [t for t in ticks if overlaps(t, band)]


def test_memory_chart_compares_tensors_with_tensors(browser: Browser, logged_in: Service, job_run: JobRun) -> None:
    """The CLI's rule: the estimate less its fixed process overhead against the measured tensor
    peaks, on one scale where the measured bars show (not 515 MiB against 5 MiB)."""
    job = logged_in.api(f"/v1/jobs/{job_run.id}")
    record = logged_in.api(f"/v1/jobs/{job_run.id}/trials/{job['best']['trial']}")["record"]
    memory, peaks = record["memory"], record["measurement"]["peak_memory"]
    tensors = memory["peak_bytes"] - memory["breakdown"]["overhead"]
    assert memory["breakdown"]["overhead"] > 0  # the CPU process's fixed overhead, in the estimate
    page = _open_job(browser, logged_in, job_run.id)
    assert "overhead" not in marks(page, "#memory rect.mem-seg", "e.dataset.part")
    assert int(page.get_attribute("#memory text.mem-total", "data-bytes") or 0) == tensors

    area = plot_area(page, "#memory svg")
    stack = sum(b["w"] for b in boxes(page, "#memory rect.mem-seg"))
    bars = boxes(page, "#memory rect.mem-bar")
    assert [int(b["data"]["bytes"]) for b in bars] == peaks
    # one scale for both, and it fits the tensors: the largest spans most of the plot
    for bar in bars:
        assert math.isclose(bar["w"] / stack, int(bar["data"]["bytes"]) / tensors, rel_tol=0.03), (bar, stack, tensors)
    assert max([stack] + [b["w"] for b in bars]) >= 0.6 * (area["right"] - area["left"])
    capacity = memory["capacity_bytes"]
    assert int(page.get_attribute("#memory g.capacity", "data-bytes") or 0) == capacity
    if capacity > 4 * max([tensors, *peaks]):  # a CPU host's RAM against megabytes of tensors
        assert "off the scale" in (page.text_content("#memory g.capacity.off-scale") or "")
    rss = record["measurement"]["extra"].get("peak_rss_bytes")
    if rss:
        assert all("RSS" in t for t in marks(page, "#memory rect.mem-bar title", "e.textContent"))


def test_cpu_devices_show_their_hosts_memory_once(browser: Browser, logged_in: Service,
                                                  cluster: dict[str, Any]) -> None:
    """CPU devices are processes sharing their host's RAM: one pair of bars per host, not the RAM per device."""
    devices = logged_in.api(f"/v1/clusters/{cluster['id']}")["latest_profile"]["profile"]["devices"]
    assert all(d["spec"]["kind"] == "cpu" for d in devices) and len(devices) == 2
    hosts: dict[int, list[dict[str, Any]]] = {}
    for i, d in enumerate(devices):
        hosts.setdefault(d["node"], []).append({"i": i, **d})
    page = browser.page
    page.goto(f"{logged_in.url}/#/clusters/{cluster['id']}")
    page.wait_for_selector("#device-memory svg")
    total = marks(page, "#device-memory rect.bar.memory-total", "[e.dataset.device, +e.dataset.value]")
    free = marks(page, "#device-memory rect.bar.memory-free", "[e.dataset.device, +e.dataset.value]")
    assert sorted(total) == sorted([",".join(str(d["i"]) for d in ds), sum(d["spec"]["memory_bytes"] for d in ds)]
                                   for ds in hosts.values())
    assert sorted(free) == sorted([",".join(str(d["i"]) for d in ds), sum(d["free_memory"] for d in ds)]
                                  for ds in hosts.values())
    assert "share their host's RAM" in page.inner_text("#shared-memory")
    assert "host total" in page.inner_text("#device-memory")


def test_candidate_map_shows_measured_or_learned_never_analytic(browser: Browser, logged_in: Service) -> None:
    """A CPU job: the plan's analytic estimates (25-30k tok/s) beside a measured 5.5k. A cell shows
    what was measured, else the learned prediction its trials ran with (labelled), else no figure."""
    def planned(tp: int, pp: int, tokens: float) -> dict[str, Any]:
        return {"config": {"tp": tp, "pp": pp}, "perf": {"tokens_per_s": tokens}}

    plan = {"ranked": [planned(1, 1, 30_000), planned(2, 1, 28_000), planned(1, 2, 25_000),
                       {**planned(1, 2, 27_000), "chance_to_fit": 0.43, "sure_to_fit": False}],
            "out_of_memory": [{"config": {"tp": 4, "pp": 1}}]}
    trials = [
        {"number": 0, "state": "ok", "config": {"tp": 1, "pp": 1}, "predicted_step_time": 128 / 6000,
         "tokens_per_s": 5500},
        {"number": 1, "state": "pruned", "config": {"tp": 2, "pp": 1}, "predicted_step_time": 128 / 5000,
         "tokens_per_s": None},
    ]
    page = draw(browser, logged_in, "candidateMap", plan, trials, 128)
    cells = {(int(c[0]), int(c[1])): c[2:] for c in marks(
        page, "g.cell", "[e.dataset.tp, e.dataset.pp, e.dataset.kind, e.dataset.value, e.textContent]")}
    assert cells[(1, 1)][:2] == ["measured", "5500"]
    assert cells[(2, 1)][0] == "learned" and close(float(cells[(2, 1)][1]), 5000)
    assert cells[(1, 2)][:2] == ["untried", ""]
    assert cells[(4, 1)][0] == "oom-pred"
    texts = "g => [...g.querySelectorAll(':scope > text')].map(t => t.textContent).join(' ')"
    drawn = {key: page.eval_on_selector(f'g.cell[data-tp="{key[0]}"][data-pp="{key[1]}"]', texts) for key in cells}
    assert "5500 tok/s" in drawn[(1, 1)] and "pred 5000" in drawn[(2, 1)] and "learned" in drawn[(2, 1)]
    assert "not tried" in drawn[(1, 2)]
    # a candidate next to the memory limit is kept with its chance to fit (pipette.fits)
    assert "1 may not fit" in drawn[(1, 2)] and "least likely 43%" in cells[(1, 2)][2]
    for analytic in (30_000, 28_000, 25_000):  # only in the tooltips, said to be analytic
        assert not any(rate(analytic) in text for text in drawn.values()), drawn
    assert "analytic" in cells[(1, 2)][2]


def test_model_error_has_one_convention(browser: Browser, logged_in: Service, job_run: JobRun) -> None:
    """The table, the MAPE card and the scatter: (measured - predicted) / predicted (the API's
    prediction_error, the CLI's ERROR %), said in the column's tooltip."""
    trials = logged_in.api(f"/v1/jobs/{job_run.id}/trials")["items"]
    page = _open_job(browser, logged_in, job_run.id)
    header = page.get_attribute('#trials-table th[data-key="prediction_error"]', "title") or ""
    assert "(measured − predicted) / predicted" in header
    shown = dict(marks(page, "#trials-table tbody tr",
                       "[+e.dataset.trial, e.querySelector('[data-col=error]').dataset.error]"))
    for t in trials:
        if t["measured_step_time"] and t["predicted_step_time"]:
            assert close(float(shown[t["number"]]), prediction_error(t))
            assert close(float(shown[t["number"]]), t["prediction_error"])
    ok = [t for t in trials if t["state"] == "ok"]
    mape = sum(abs(prediction_error(t)) for t in ok) / len(ok)
    assert page.inner_text("#card-error .v") == f"{mape * 100:.1f}%"
    assert "(measured − predicted) / predicted" in (page.get_attribute("#card-error", "title") or "")
    assert close(float(page.get_attribute("#scatter svg", "data-mape") or 0), mape)


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
