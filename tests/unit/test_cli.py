"""`pipette plan` as a user runs it: output, files, --json, and every bad input.

Bad input must exit non-zero with one line naming the field and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "examples" / "clusters"
RECIPES = ROOT / "examples" / "recipes"


def pipette(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True,
        cwd=cwd or ROOT, timeout=60,
    )


def test_plan_prints_ranked_candidates_and_writes_launch_files(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    r = pipette("plan", "--model", "llama2-7b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"),
                "--recipe", str(RECIPES / "llama2-7b-lora.yaml"), "--top", "5", "--out", str(out))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "tokens/s" in text and "MFU" in text and "dropped:" in text and "best:" in text
    assert "time per step:" in text and "memory on the heaviest rank" in text
    files = {"ds_config.json", "hostfile", "rank_map.json", "candidate.json", "launch.sh"}
    assert {p.name for p in out.iterdir()} == files
    ds = json.loads((out / "ds_config.json").read_text())
    cand = json.loads((out / "candidate.json").read_text())["config"]
    assert ds["train_batch_size"] == 64
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * cand["dp"] == 64
    assert ds["zero_optimization"]["stage"] == cand["zero_stage"]
    ranks = json.loads((out / "rank_map.json").read_text())
    assert sorted(r["device"] for r in ranks) == list(range(16))
    assert (out / "hostfile").read_text().splitlines() == ["node0 slots=8", "node1 slots=8"]
    assert "-m deepspeed.launcher.runner --hostfile ./hostfile" in (out / "launch.sh").read_text()


def test_plan_json_is_machine_readable(tmp_path: Path) -> None:
    r = pipette("plan", "--model", "tiny-llama", "--cluster", str(CLUSTERS / "cpu-4.yaml"),
                "--global-batch", "16", "--seq-len", "128", "--method", "lora", "--json",
                "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    ranked = data["ranked"]
    assert ranked and ranked == sorted(ranked, key=lambda p: p["perf"]["step_time"])
    assert data["feasible"] >= len(ranked) and data["enumerated"] > 0
    assert all(p["memory"]["peak_bytes"] <= p["memory"]["capacity_bytes"] for p in ranked)
    assert data["launch_command"].startswith('"${PIPETTE_PYTHON:-python3}" -m deepspeed.launcher.runner')
    assert data["launch_command"].endswith("/rank_map.json")


def _assert_one_line_error(r: subprocess.CompletedProcess[str], *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipette: error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_unknown_preset() -> None:
    r = pipette("plan", "--model", "llama3-8", "--cluster", str(CLUSTERS / "a100-2x8.yaml"),
                "--global-batch", "8", "--seq-len", "128")
    _assert_one_line_error(r, "model:", "unknown model preset", "fix: did you mean llama3-8b", "docs/inputs.md")


def test_non_square_link_matrix(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("device: A100-80GB\nnodes: 1\ndevices_per_node: 3\n"
                 "links: {bandwidth: [[0, 1, 1], [1, 0, 1]]}\n")
    r = pipette("plan", "--model", "llama2-7b", "--cluster", str(f), "--global-batch", "8", "--seq-len", "128")
    _assert_one_line_error(r, "cluster.links.bandwidth", "not square", "3x3")


def test_negative_bandwidth(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text('{"device": "H100-80GB", "nodes": 2, "devices_per_node": 2,'
                 ' "intra_node": {"bandwidth": 1e11}, "inter_node": {"bandwidth": -5}}')
    r = pipette("plan", "--model", "llama2-7b", "--cluster", str(f), "--global-batch", "8", "--seq-len", "128")
    _assert_one_line_error(r, "cluster.inter_node.bandwidth", "not positive")


def test_malformed_cluster_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("device: [unclosed\n")
    r = pipette("plan", "--model", "llama2-7b", "--cluster", str(f), "--global-batch", "8", "--seq-len", "128")
    _assert_one_line_error(r, "not valid YAML")


def test_recipe_no_configuration_satisfies() -> None:
    r = pipette("plan", "--model", "tiny-llama", "--cluster", str(CLUSTERS / "cpu-4.yaml"),
                "--global-batch", "3", "--seq-len", "64", "--micro-batches", "2")
    _assert_one_line_error(r, "no configuration", "fix:")


def test_nothing_fits_says_by_how_much_and_what_helps() -> None:
    r = pipette("plan", "--model", "llama2-70b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"),
                "--global-batch", "16", "--seq-len", "4096", "--zero", "0", "--recompute", "none",
                "--micro-batches", "2,4")
    _assert_one_line_error(r, "nothing fits", "2% chance", "short by", "GiB", "more devices", "LoRA", "ZeRO-3",
                           "recomputation")


@pytest.mark.parametrize("flag", [["--top", "0"], ["--margin", "1.5"], ["--zero", "one"]])
def test_bad_flags(flag: list[str]) -> None:
    r = pipette("plan", "--model", "tiny-llama", "--cluster", str(CLUSTERS / "cpu-4.yaml"),
                "--global-batch", "8", "--seq-len", "64", "--no-files", *flag)
    _assert_one_line_error(r)


def test_help_has_examples() -> None:
    r = pipette("plan", "--help")
    assert r.returncode == 0 and "examples:" in r.stdout


# ---- every input checked, the first real error named by its flag (issue 17, items 2, 3, 5) ----
CPU4 = str(CLUSTERS / "cpu-4.yaml")


def test_a_missing_global_batch_names_the_flag_that_gives_it() -> None:
    r = pipette("plan", "--model", "tiny-llama", "--cluster", CPU4, "--seq-len", "32")
    _assert_one_line_error(r, "--global-batch: is required", "give --global-batch N", "--recipe")


@pytest.mark.parametrize(("args", "words"), [
    (["--cluster", "/nonexistent.yaml"], ["--cluster: no such file '/nonexistent.yaml'"]),
    (["--cluster", CPU4, "--zero", "5"], ["--zero: unknown value(s) 5"]),
    (["--cluster", CPU4, "--top", "0"], ["--top: is 0"]),
    (["--cluster", CPU4, "--model", "/"], ["--model: the folder '/' holds no config.json"]),
])
def test_the_first_real_error_is_reported_not_the_missing_batch(args: list[str], words: list[str]) -> None:
    """Was: 'training.global_batch: is required (fix: give it)' for every one of these."""
    base = ["plan", "--model", "tiny-llama"] if "--model" not in args else ["plan"]
    _assert_one_line_error(pipette(*base, *args), *words)


def test_a_sequence_longer_than_the_model_is_refused_naming_its_maximum() -> None:
    r = pipette("plan", "--model", "llama2-7b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"),
                "--global-batch", "16", "--seq-len", "1000000")
    _assert_one_line_error(r, "--seq-len: is 1000000, more than the 4096 positions llama2-7b has",
                           "at most 4096")


def test_a_model_folder_holding_config_json_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 344, "vocab_size": 512, "max_position_embeddings": 256}))
    r = pipette("plan", "--model", str(tmp_path), "--cluster", CPU4, "--global-batch", "4", "--seq-len", "32",
                "--no-files", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ranked"]


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "cli", "plan", "--model", "llama2-7b", "--cluster",
                             str(CLUSTERS / "a100-2x8.yaml"), "--global-batch", "16", "--seq-len", "4096",
                             "--no-files", "--top", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_a_mixtral_folder_is_planned_with_its_experts_on_the_default_stack(tmp_path: Path) -> None:
    """Issue 32, item 6: Mixtral's config.json was planned silently as a dense 7.24B model. Issue 47:
    it is read with its experts; Pipette's DeepSpeed runner refused it, and now trains it under
    DeepSpeed's AutoEP: the plan's layouts split the experts (ep) and say which DeepSpeed runs them."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768}))
    r = pipette("plan", "--model", str(tmp_path), "--cluster", str(CLUSTERS / "a100-2x8.yaml"),
                "--global-batch", "16", "--seq-len", "4096", "--no-files")
    assert r.returncode == 0, r.stderr
    assert "46.70B params" in r.stdout and "ep" in next(x for x in r.stdout.splitlines() if "#  tp" in x).split()
    best = next(x for x in r.stdout.splitlines() if x.startswith("best: "))
    assert "-ep8-" in best and "experts: DeepSpeed's AutoEP" in r.stdout


def test_a_model_the_runners_do_not_build_is_refused_before_planning(tmp_path: Path) -> None:
    """A Mistral 7B v0.1-shaped config.json whose sliding window (32 tokens) the sequences exceed was read
    as Llama's attention and its trials trained a Llama over the whole sequence; read as it is, ``tune``
    planned it and then said "none of the 102 candidates that fit can be run by the trial backend" with
    a fix about schedules. Now one line before the machine is measured or anything planned (no Ray is
    started), naming what the runners do not build and the way to tune it."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 256,
        "sliding_window": 32}))
    r = pipette("tune", "--model", str(tmp_path),  # no cluster file: refused before the machine is measured
                "--global-batch", "8", "--seq-len", "64", "--home", str(tmp_path / "home"))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "planning" not in r.stderr, r.stderr
    error = r.stderr.strip().splitlines()[-1]  # after the two lines that say whose prices these are
    assert error.startswith("pipette: error: --model: the runner builds Llama's, Qwen2's and Qwen3's attention"), error
    assert "a sliding window of 32 under longer sequences" in error and "tune your own training script (--script)" \
        in error


def test_an_moe_plan_lists_each_layout_once_with_its_expert_degrees() -> None:
    """Issue 47: every tp-1 layout of an MoE plan was listed twice (etp 1 and etp = tp, one layout),
    and a layout whose experts drop tp (etp 1) read like its twin with etp = tp: no etp column."""
    r = pipette("plan", "--model", "qwen3-30b-a3b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"),
                "--global-batch", "64", "--seq-len", "2048", "--method", "lora", "--stack", "megatron",
                "--top", "400", "--no-files")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "tp"])
    assert lines[head].split()[4:7] == ["ep", "etp", "mbs"], lines[head]
    rows = [line.split()[1:] for line in lines[head + 1:] if line.split() and line.split()[0].isdigit()]
    layouts = [tuple(row[:9]) for row in rows]  # tp .. schedule: the layout as the table shows it
    assert len(rows) > 100 and len(set(layouts)) == len(layouts), "a layout listed twice"
    assert {row[4] for row in rows if row[0] == "2"} == {"1", "2"}, "tp 2's experts both ways"


@pytest.mark.parametrize(("signum", "code", "said"), [
    (2, 130, "pipette: interrupted"), (15, 143, "pipette: terminated (SIGTERM)"),
])
def test_a_signal_ends_a_command_with_the_shells_code_and_a_word(tmp_path: Path, signum: int, code: int,
                                                                  said: str) -> None:
    """Issue 32, item 7: SIGTERM ended a command silently (Ray's handler: exit 15, or none)."""
    import os
    import signal
    import time

    env = {**os.environ, "HOME": str(tmp_path), "PIPETTE_CONFIG": str(tmp_path / "c.json")}
    env.pop("PIPETTE_TOKEN", None)
    # `login --with-token` waits on stdin: a command blocked where the user might stop it
    # SIGINT restored in the child: under a shell's background job (`pytest ... &`) it is
    # ignored, and Python keeps an ignored SIGINT ignored
    proc = subprocess.Popen([sys.executable, "-m", "cli", "login", "--with-token"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # wait until it blocks reading stdin (a fixed sleep raced the imports on a loaded machine)
    wchan, deadline = Path(f"/proc/{proc.pid}/wchan"), time.monotonic() + 60
    while "pipe_read" not in wchan.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "pipe_read" in wchan.read_text(), "the command never read its stdin"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code and said in err and "Traceback" not in err, (proc.returncode, err)


def _tune_parser() -> argparse.ArgumentParser:
    from cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["tune"]
    return parser


def test_tune_help_gives_every_default_and_calls_nothing_required() -> None:
    """Issue 32, item 8: --global-batch said "required" though tune defaults it to 16, and
    --trial-timeout showed no default."""
    for action in _tune_parser()._actions:
        if action.help in (None, argparse.SUPPRESS) or action.nargs == 0:
            continue  # -h and on/off flags
        flag = action.option_strings[0]
        assert "default" in action.help, f"{flag}: {action.help}"
        assert "required" not in action.help, f"{flag}: {action.help}"
        if isinstance(action.default, int | float) and not isinstance(action.default, bool):
            assert f"{action.default:g}" in action.help, f"{flag} defaults to {action.default}: {action.help}"


def test_tune_help_examples_are_whole_command_lines() -> None:
    """A continuation line lost its backslash (a Python escape ate it): the example ran as two
    commands. Each example is read back as one command line by tune's own parser."""
    import shlex

    from cli.tune import TUNE_EXAMPLES

    shown = TUNE_EXAMPLES.split("examples:\n", 1)[1]
    for physical in shown.splitlines():  # was: "hf-trainer       --script ...", 150 characters
        assert "   " not in physical.split("#")[0].strip() and len(physical) <= 110, physical
    text = shown.replace("\\\n", " ")
    lines = [line.split("#")[0].split(">")[0].strip() for line in text.splitlines() if line.strip()]
    assert len(lines) == 4, lines
    for line in lines:
        words = [w for w in shlex.split(line) if "=" not in w.split("-")[0] or w.startswith("-")]
        assert words[:2] == ["pipette", "tune"], line
        _tune_parser().parse_args(words[2:])  # exits 2 on a word it does not know


def test_data_help_says_it_is_tokenised_as_bytes() -> None:
    r = pipette("tune", "--help")
    assert "tokenised as raw UTF-8 bytes" in " ".join(r.stdout.split())


def test_pipettes_flags_after_script_stop_the_tune_before_measuring(tmp_path: Path) -> None:
    """Issue 32, item 10: `--global-batch 16 --devices 2 --script-kind deepspeed` after --script went
    silently to the script (7.6 minutes, every trial failed); issue 43, item 16: then with a warning,
    and the tune still ran (210 s of trials ending in the script's own argument error). Now it stops
    before measuring (no profile written), with the command as it should read."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit(0)\n")
    r = pipette("tune", "--home", str(tmp_path / "home"), "--script", "python", str(script), "--global-batch", "16",
                "--devices=2", "--script-kind", "deepspeed", "--lr", "3e-4", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--script: is followed by Pipette's own --global-batch, --devices, --script-kind" in lines[0], lines[0]
    fixed = f"put them before --script: pipette tune ... --global-batch 16 --devices=2 --script-kind deepspeed " \
            f"--script python {script} --lr 3e-4"
    assert fixed in lines[0] and "--script-shares-flags" in lines[0], lines[0]
    assert not (tmp_path / "home").exists()  # nothing measured, nothing kept
    r = pipette("tune", "--home", str(tmp_path / "home"), "--script", "python", "nothere.py", "--lr", "3e-4",
                cwd=tmp_path)
    assert "Pipette's own" not in r.stderr


def test_a_script_that_shares_a_flag_name_says_so() -> None:
    from cli.tune import _refuse_pipette_flags, pipette_flags_in

    assert pipette_flags_in(["python", "t.py", "--seed", "3", "--json", "--lr", "1"]) == (
        ["--seed", "3", "--json"], ["python", "t.py", "--lr", "1"])
    _refuse_pipette_flags(["python", "t.py", "--seed", "3"], shared=True)  # the script's own --seed: goes on
    with pytest.raises(Exception, match="--seed"):
        _refuse_pipette_flags(["python", "t.py", "--seed", "3"], shared=False)


def test_a_failed_trials_whole_reason_and_output_are_shown() -> None:
    """Issue 32, item 10: trial lines were cut at 160 characters and to their first line, and a
    timed-out script's output was not kept."""
    from cli.tune import _peak_text, _reason_lines
    from pipette.measurement import Measurement

    long = "RuntimeError: " + "x" * 300
    error = f"rank 1 exited with status 1\nTraceback (most recent call last):\n  File \"t.py\", line 3\n{long}"
    lines = _reason_lines(Measurement("failed", error=error))
    assert lines == error.splitlines(), lines
    timeout = Measurement("timeout", error="the script reported no step in 180 s",
                          extra={"output_tail": "loading\nwaiting for a lock"})
    assert _reason_lines(timeout)[-3:] == ["its output ended with:", "  loading", "  waiting for a lock"]
    many = Measurement("failed", error="\n".join(f"line {i}" for i in range(100)))
    shown = _reason_lines(many)
    assert len(shown) <= 41 and shown[0] == "line 0" and shown[-1] == "line 99" and "in the trial's record" in shown[1]
    # a CPU script trial has no tensor peak: its peak RSS stands in, marked as such
    assert _peak_text(Measurement("ok", extra={"peak_rss_bytes": [600 * 2**20, 812 * 2**20]})) == "812 RSS"
    assert _peak_text(Measurement("ok", peak_memory=(2**20 * 40,))) == "40"


def test_plan_writes_launch_files_for_the_fastest_candidate_sure_to_fit(tmp_path: Path) -> None:
    """Issue 43, item 19: llama3-8b's best-ranked candidate needs 83.0 of 80 GiB (43% chance to fit);
    its launch files were written for it. A launch cannot retry after running out of memory, so
    the files are for the fastest candidate sure to fit, with the faster, riskier one named beside it."""
    from pipette.fits import SURE_TO_FIT

    args = ("plan", "--model", "llama3-8b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"),
            "--recipe", str(RECIPES / "llama2-7b-lora.yaml"))
    r = pipette(*args, "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    data = json.loads(pipette(*args, "--json", "--no-files").stdout)
    best, ranked = data["ranked"][0], data["ranked"]
    assert not best["sure_to_fit"]  # the riskier bet ranks first
    sure = [p for p in ranked if p["chance_to_fit"] >= SURE_TO_FIT]
    fastest_sure = min(sure, key=lambda p: p["perf"]["step_time"])
    assert data["launch_pick"]["label"] == fastest_sure["label"] and data["launch_pick"]["sure_to_fit"]
    written = json.loads((tmp_path / "o" / "candidate.json").read_text())["config"]
    assert written == fastest_sure["config"]
    rank = data["launch_pick"]["rank"]
    assert f"launch files for #{rank} {fastest_sure['label']}, the fastest sure to fit" in r.stdout
    assert "sure means 90% or more" in r.stdout
    riskier = next(line for line in r.stdout.splitlines() if "faster but riskier" in line)
    # 49% since the runner's capacity check compares the device-used figure (issue 46; 43% on the reserve)
    assert f"#1 {best['label']}" in riskier and "49% chance to fit" in riskier
    assert fastest_sure["label"] in (tmp_path / "o" / "launch.sh").read_text().splitlines()[1]
