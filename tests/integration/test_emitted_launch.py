"""The launch files Pipette emits run the same job as the trial: ``launch.sh`` run for real
with the ``deepspeed`` launcher on this machine (one node, 2 CPU devices, gloo)."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipette.cluster import ClusterProfile
from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.contract import EVENT_PREFIX
from pipette.emit import write_launch_files
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.host.executor import run_trial
from workers.phases import ORDER
from workers.spec import TrialSpec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_emitted_launch_runs_the_trials_job(tmp_path: Path) -> None:
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    # tp=2 on devices 3 and 2: the launcher numbers the processes by device (2, 3), so the
    # rank map must swap them for rank 0 to run on device 3.
    config = ParallelConfig(tp=2, pp=1, dp=1, mbs=2, global_batch=4, placement=(3, 2))
    spec = TrialSpec(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=4, seq_len=32, dtype="fp32"), config,
                     warmup_steps=2, min_steps=3, max_steps=3)
    files = _trial_files(tmp_path, spec, cluster)
    assert str(files["launch.sh"].parent) == str(tmp_path)
    assert json.loads(files["ds_config.json"].read_text()) == spec.ds_config()
    script = files["launch.sh"].read_text()
    assert "--no_ssh" in script and "--include node0:3,2" in script
    assert '--master_port "${MASTER_PORT:-29500}"' in script

    with socket.socket() as sock:  # a free rendezvous port: not 29500, which another launch may hold
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # As a user runs it, as printed by `pipette tune`: from a shell whose PATH has no .venv (no
    # `deepspeed` command), without the trial's OMP_NUM_THREADS; launch.sh finds both itself.
    venv = str(Path(sys.executable).parent)
    path = ":".join(p for p in os.environ["PATH"].split(":") if p != venv)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"PATH": path, "MASTER_PORT": str(port)}
    assert subprocess.run(["bash", "-c", "command -v deepspeed"], env=env, capture_output=True).returncode != 0
    out, shown = _run(files, env)
    events = _events(out)

    ranks = {int(e["launcher_rank"]): e for e in events if e["event"] == "rank"}
    assert {k: (v["rank"], v["device_kind"]) for k, v in ranks.items()} == {0: (1, "cpu"), 1: (0, "cpu")}
    assert {v["master_port"] for v in ranks.values()} == {str(port)}  # MASTER_PORT reached the launcher
    finished = {int(e["rank"]): e for e in events if e["event"] == "done"}
    assert set(finished) == {0, 1}
    assert finished[0]["backend"] == "deepspeed+engine+zero0+megatron-tp"
    assert len(finished[0]["step_times"]) == 3 and len(finished[0]["losses"]) == 5
    # issue 43, item 20: the terminal gets no raw events nor the launcher's INFO lines (they are in
    # launch.log), and the launch ends with its step time and tokens/s
    assert EVENT_PREFIX not in shown and "[INFO]" not in shown and "ranks: timed steps" in shown, shown[-3000:]
    step = statistics.median(max(a, b) for a, b in zip(finished[0]["step_times"], finished[1]["step_times"],
                                                       strict=True))
    last = shown.strip().splitlines()[-1]
    assert last.startswith(f"launch of {config.label}: 3 timed steps on 2 ranks here: step time {step:.4f} s "
                           f"(median), {spec.training.tokens_per_step / step:,.0f} tokens/s"), last
    assert last.endswith("(full output: launch.log)"), last

    # The trial runner on Ray, with the same candidate, computes the same losses.
    trial = run_trial(spec, timeout_s=240)
    assert trial.status == "ok", trial.error
    assert finished[0]["losses"] == pytest.approx(list(trial.losses), rel=1e-5)
    assert finished[1]["losses"] == pytest.approx(list(trial.losses), rel=1e-5)
    # ... at the trial's speed: the launch sets what the trial's ranks had (one intra-op thread
    # per rank). Unpinned it ran 4-16x slower; repeats of one candidate spread up to 1.44x here.
    # Either side can be the slow one under load: once in CI the trial ran 2.25x slower than the
    # launch (ratio 0.44), once the launch 2.25x slower than two trials (2.25, 2.34). Load only
    # slows a run, so a ratio out of bounds times both once more and keeps each one's faster
    # median; a pinning fault is slow every time and still fails.
    launched = statistics.median(max(a, b) for a, b in zip(finished[0]["step_times"], finished[1]["step_times"],
                                                           strict=True))
    trial_step = statistics.median(trial.step_times)
    ratio = launched / trial_step
    if not 1 / 2 <= ratio <= 2:
        print(f"launch / trial step time {ratio:.2f} out of bounds (load average {os.getloadavg()[0]:.1f}): "
              "both timed once more")
        launched = min(launched, statistics.median(_launch(files, env | {"MASTER_PORT": str(_free_port())})))
        again = run_trial(spec, timeout_s=240)
        assert again.status == "ok", again.error
        trial_step = min(trial_step, statistics.median(again.step_times))
        ratio = launched / trial_step
    print(f"launch / trial step time: {ratio:.2f}")
    assert 1 / 2 <= ratio <= 2, ratio


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _session(sid: int) -> list[int]:
    """The processes of session ``sid``."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[3]) == sid:
            found.append(int(p))
    return found


def _launch(files: dict[str, Path], env: dict[str, str], on_ranks_up: Callable[[], None] | None = None) -> list[float]:
    """Run ``launch.sh`` as a user does; returns its steps' times (the slowest rank's).
    ``on_ranks_up``: called once every rank has said its ``rank`` event (its imports done)."""
    launcher = subprocess.Popen(["bash", "-c", f"(cd {files['launch.sh'].parent} && ./launch.sh)"], cwd="/", env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log_path = files["launch.sh"].parent / "launch.log"
    try:
        if on_ranks_up is not None:
            world = len(json.loads(files["rank_map.json"].read_text()))
            deadline = time.monotonic() + 400
            while launcher.poll() is None and time.monotonic() < deadline:
                text = log_path.read_text() if log_path.exists() else ""
                if text.count(f'{EVENT_PREFIX}{{"event": "rank"') >= world:
                    on_ranks_up()
                    break
                time.sleep(0.1)
        out, err = launcher.communicate(timeout=400)
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    log = log_path.read_text()  # every line of the launch's output
    done = _events(log)
    times = [e["step_times"] for e in done if e["event"] == "done"]
    return [max(ts) for ts in zip(*times, strict=True)]


class _Neighbours:
    """Two busy processes, a session each, from ``start`` to ``stop``."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        if not self.procs:
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                          for _ in range(2)]
            assert all(n.poll() is None and _session(n.pid) == [n.pid] for n in self.procs)

    def on_phase(self, phase: str, elapsed: float) -> None:
        """A trial's ``on_phase``: start once its slowest rank is past its imports."""
        if phase in ORDER and ORDER.index(phase) > ORDER.index("imports"):
            self.start()

    def stop(self) -> None:
        """End them; they must have run all along (started, and still busy now)."""
        procs, self.procs = self.procs, []
        alive = [n.poll() is None for n in procs]
        for n in procs:
            n.kill()
            n.wait()
        assert len(procs) == 2 and all(alive), "the neighbours were not busy throughout the steps"


@pytest.mark.timeout(900)
def test_the_launch_runs_at_its_trials_speed_beside_a_busy_neighbour(tmp_path: Path) -> None:
    """Issue 32, item 5: ``launch.sh`` of the pick ran 1.48-1.53x slower per step than its trial.
    Linux shares the CPU between sessions first (autogroup): a trial's ranks are a session each,
    a launcher's ranks were one session together, so beside any other busy session they got a
    fraction of the CPU the trial had. Here the neighbours are two busy processes, a session
    each; the candidate is what `./dev tune` picks on this machine (4 CPU ranks)."""
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    config = ParallelConfig(tp=1, pp=1, dp=4, mbs=4, global_batch=16, zero_stage=2)
    training = TrainingSpec(global_batch=16, seq_len=128, dtype="fp32", method="lora")
    spec = TrialSpec(ModelSpec.preset("tiny-llama"), training, config, warmup_steps=2, min_steps=10, max_steps=10)
    files = _trial_files(tmp_path, spec, cluster)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS")} | {"MASTER_PORT": str(port)}
    # The neighbours run from the moment the ranks have imported their stack until they end, in the
    # trial and in the launch alike: the steps are what is compared, and the launch's imports (five
    # processes, ~8 CPU-s each) beside them only made the test slower.
    neighbours = _Neighbours()
    try:
        ratios = []
        # Load only slows a run: a ratio out of bounds is timed again, three tries at most, the bound 1.1 a
        # try (CI once saw 1.15 then 1.11 on the fixed tree; before the fix 1.45 and 1.24: docs/results.md).
        for _ in range(3):
            trial = run_trial(spec, timeout_s=300, on_phase=neighbours.on_phase)
            neighbours.stop()
            assert trial.status == "ok", trial.error
            launched = statistics.median(_launch(files, env, on_ranks_up=neighbours.start))
            neighbours.stop()
            ratios.append(launched / statistics.median(trial.step_times))
            print(f"launch / trial step time beside a busy neighbour: {ratios[-1]:.2f}")
            if ratios[-1] <= 1.1:
                break
    finally:
        for n in neighbours.procs:
            n.kill()
            n.wait()
    assert min(ratios) <= 1.1, ratios


def test_the_native_runners_launch_runs_the_fsdp_trials_job(tmp_path: Path) -> None:
    """An fsdp pick's ``launch.sh``: Pipette's PyTorch-native runner under ``torchrun``, as printed
    (a shell without the venv on PATH), computes the losses its trial computed, at its speed. Before,
    the fsdp stack's files held no launcher at all; under torchrun the agent serves the rendezvous
    store, so every rank joins it as a client (``workers.rank.store``)."""
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    config = ParallelConfig(tp=1, pp=2, dp=2, mbs=2, global_batch=8, zero_stage=3, placement=(3, 2, 1, 0),
                            stack="fsdp")
    spec = TrialSpec(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=8, seq_len=32, dtype="fp32"), config,
                     warmup_steps=2, min_steps=3, max_steps=3, stack="fsdp")
    files = _trial_files(tmp_path, spec, cluster)
    assert sorted(files) == ["candidate.json", "hostfile", "launch.sh", "rank_map.json"]  # no ds_config.json
    script = files["launch.sh"].read_text()
    assert "-m torch.distributed.run --nnodes 1 --nproc_per_node 4 --node_rank 0" in script
    assert "-m workers.rank.fsdp --candidate candidate.json --rank_map rank_map.json" in script
    venv = str(Path(sys.executable).parent)
    path = ":".join(p for p in os.environ["PATH"].split(":") if p != venv)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"PATH": path, "MASTER_PORT": str(_free_port())}
    assert subprocess.run(["bash", "-c", "command -v torchrun"], env=env, capture_output=True).returncode != 0

    out, shown = _run(files, env)
    # rank 0 joins the store torchrun's agent serves on MASTER_PORT; before, it found the port taken
    # and fell back to torch's own server, which failed to bind too (torch logged it and went on)
    assert "rendezvous store cannot listen" not in out, out[-2000:]
    assert shown.strip().splitlines()[-1].startswith(f"launch of {config.label}: 3 timed steps on 4 ranks"), shown
    events = _events(out)
    ranks = {int(e["launcher_rank"]): e for e in events if e["event"] == "rank"}
    assert sorted(ranks) == [0, 1, 2, 3] and {v["master_port"] for v in ranks.values()} == {env["MASTER_PORT"]}
    finished = {int(e["rank"]): e for e in events if e["event"] == "done"}
    assert sorted(finished) == [0, 1, 2, 3], out[-3000:]
    assert all(e["backend"].startswith("fsdp2-full-shard") and "pp-1f1b" in e["backend"] for e in finished.values())

    trial = run_trial(spec, timeout_s=240)
    assert trial.status == "ok", f"{trial.error}\n{trial.extra.get('output_tail')}"
    reported = [e["losses"] for e in finished.values() if e["losses"]]
    assert reported and all(ls == pytest.approx(list(trial.losses), rel=1e-5) for ls in reported)
    launched = statistics.median(max(ts) for ts in zip(*(e["step_times"] for e in finished.values()), strict=True))
    ratio = launched / statistics.median(trial.step_times)
    if not 1 / 2 <= ratio <= 2:  # load only slows a run: out of bounds, both are timed once more
        print(f"launch / trial step time {ratio:.2f} out of bounds (load average {os.getloadavg()[0]:.1f})")
        again = run_trial(spec, timeout_s=240)
        assert again.status == "ok", again.error
        launched = min(launched, statistics.median(_launch(files, env | {"MASTER_PORT": str(_free_port())})))
        ratio = launched / min(statistics.median(trial.step_times), statistics.median(again.step_times))
    print(f"native launch / trial step time: {ratio:.2f}")
    assert 1 / 2 <= ratio <= 2, ratio


def test_a_context_parallel_picks_launch_runs_its_trials_job(tmp_path: Path) -> None:
    """Issue 48: an fsdp pick with cp = 2 (the sequence split over two ranks, the runner's own ring on
    CPU ranks), its ``launch.sh`` run as printed: every rank reports the cp backend and the losses its
    trial computed."""
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    model = ModelSpec(name="tiny-long", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                      max_seq=512, tied_embeddings=False, arch="llama")
    config = ParallelConfig(tp=1, pp=1, dp=2, cp=2, mbs=1, global_batch=2, zero_stage=3, stack="fsdp")
    spec = TrialSpec(model, TrainingSpec(global_batch=2, seq_len=512, dtype="fp32"), config,
                     warmup_steps=1, min_steps=2, max_steps=2, stack="fsdp")
    files = _trial_files(tmp_path, spec, cluster)
    assert json.loads(files["candidate.json"].read_text())["config"]["cp"] == 2
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"MASTER_PORT": str(_free_port())}

    out, shown = _run(files, env)
    assert shown.strip().splitlines()[-1].startswith(f"launch of {config.label}: 2 timed steps on 4 ranks"), shown
    events = _events(out)
    finished = {int(e["rank"]): e for e in events if e["event"] == "done"}
    assert sorted(finished) == [0, 1, 2, 3], out[-3000:]
    assert {e["backend"] for e in finished.values()} == {"fsdp2-full-shard+cp2-ring"}

    trial = run_trial(spec, timeout_s=240)
    assert trial.status == "ok", f"{trial.error}\n{trial.extra.get('output_tail')}"
    reported = [e["losses"] for e in finished.values() if e["losses"]]
    assert reported and all(ls == pytest.approx(list(trial.losses), rel=1e-5) for ls in reported)


def _trial_files(directory: Path, spec: TrialSpec, cluster: ClusterProfile) -> dict[str, Path]:
    """The launch files of ``spec``'s candidate in its stack, with the trial's runner options (the device
    kind left out: the launch finds it)."""
    options = {k: v for k, v in spec.runner_options().items() if k != "device_kind"}
    return write_launch_files(directory, spec.model, spec.training, spec.config, cluster, extra={"trial": options},
                              stack=spec.stack)


def _events(text: str) -> list[dict[str, Any]]:
    """The ranks' events in a launch's output."""
    return [json.loads(line[len(EVENT_PREFIX):]) for line in text.splitlines() if line.startswith(EVENT_PREFIX)]


def _run(files: dict[str, Path], env: dict[str, str]) -> tuple[str, str]:
    """``launch.sh`` run as a user does (from another folder): its log (every line of the launch's
    output, the ranks' events among them) and what it showed on the terminal (stdout and stderr)."""
    launcher = subprocess.Popen(["bash", "-c", f"(cd {files['launch.sh'].parent} && ./launch.sh)"], cwd="/", env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = launcher.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        out, err = launcher.communicate()
        pytest.fail("the launch ran past 240 s:\n" + out[-3000:] + err[-3000:])
    finally:  # the launcher and its ranks share its session: leave nothing running
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    return (files["launch.sh"].parent / "launch.log").read_text(), out + err


TWO_HOSTS = """name: two-hosts-on-loopback
device: {preset: cpu, memory: 5 GiB}
nodes: [{name: host-a, address: 127.0.0.1, devices: 1}, {name: host-b, devices: 1}]
intra_node: {bandwidth: 2 GB/s, latency: 50 us}
inter_node: {bandwidth: 1 GB/s, latency: 80 us}
"""


@pytest.mark.parametrize("stack", ["pipette", "fsdp"])
def test_a_two_node_launch_runs_as_printed_one_command_per_host(tmp_path: Path, stack: str) -> None:
    """Issue 43, item 14: a 2-node pick's ``launch.sh``, run as ``plan`` prints it, one command per
    host, both on this machine (host-a at 127.0.0.1 holds the rendezvous; host-b is only a name to
    the launchers). The placement puts rank 0 on host-b, so each node's launcher must hand its
    process the rank the map gives it. Before, DeepSpeed's runner refused the ``--include``
    (``ValueError: too many values to unpack``) and an fsdp plan printed one command for both."""
    from pipette.emit import launch_sh_lines

    (tmp_path / "cluster.yaml").write_text(TWO_HOSTS)
    cluster = load_cluster(tmp_path / "cluster.yaml")
    config = ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=4, placement=(1, 0), stack=stack)
    spec = TrialSpec(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=4, seq_len=32, dtype="fp32"), config,
                     warmup_steps=1, min_steps=2, max_steps=2, stack=stack)
    out = tmp_path / "best"
    _trial_files(out, spec, cluster)
    printed = launch_sh_lines(str(out), config, cluster)
    assert printed[0].startswith("launch: on each of its 2 nodes") and len(printed) == 3, printed
    commands = {line.split(": ", 1)[0].strip(): line.split(": ", 1)[1] for line in printed[1:]}
    assert list(commands) == ["on 127.0.0.1", "on host-b"]  # a host is named by its address, else its name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS", "NODE_RANK")}
    env["MASTER_PORT"] = str(_free_port())
    nodes = [subprocess.Popen(["bash", "-c", command], cwd="/", env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for command in commands.values()]
    outputs = []
    try:
        for node in nodes:
            out_text, err = node.communicate(timeout=240)
            assert node.returncode == 0, out_text[-3000:] + err[-3000:]
            outputs.append(out_text)
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    logs = [(out / f"launch-node{i}.log").read_text() for i in range(2)]  # each node's own log
    events = [_events(text) for text in logs]
    assert all(text.strip().splitlines()[-1].startswith(f"launch of {config.label}: 2 timed steps on 1 rank here")
               for text in outputs), outputs
    done = [[e for e in node if e["event"] == "done"] for node in events]
    # node 0 (host-a, device 0) runs rank 1; node 1 (host-b, device 1) runs rank 0
    assert [[int(e["rank"]) for e in events] for events in done] == [[1], [0]], outputs
    assert len(done[1][0]["step_times"]) == 2
    # the trial of the same candidate computes rank 0's losses: the same job
    trial = run_trial(spec, timeout_s=240)
    assert trial.status == "ok", trial.error
    assert done[1][0]["losses"] == pytest.approx(list(trial.losses), rel=1e-5)


def test_an_moe_candidates_launch_runs_its_experts_under_autoep(tmp_path: Path) -> None:
    """Issue 47: the pipette stack's ep 2 candidate of tiny-moe (Mixtral's shape): its launch.sh runs
    DeepSpeed's AutoEP as the trial does (ds_config ``expert_parallel``) and computes the trial's losses."""
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    config = ParallelConfig(tp=1, pp=1, dp=2, ep=2, mbs=2, global_batch=4, zero_stage=1)
    spec = TrialSpec(ModelSpec.preset("tiny-moe"), TrainingSpec(global_batch=4, seq_len=32, dtype="fp32"), config,
                     warmup_steps=2, min_steps=3, max_steps=3)
    files = _trial_files(tmp_path, spec, cluster)
    assert json.loads(files["ds_config.json"].read_text())["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    venv = str(Path(sys.executable).parent)
    path = ":".join(p for p in os.environ["PATH"].split(":") if p != venv)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONPATH")}
    out, _ = _run(files, env | {"PATH": path, "MASTER_PORT": str(_free_port())})
    events = _events(out)
    finished = {int(e["rank"]): e for e in events if e["event"] == "done"}
    assert set(finished) == {0, 1} and finished[0]["backend"] == "deepspeed+engine+zero1+autoep2"
    trial = run_trial(spec, timeout_s=240)
    assert trial.status == "ok", trial.error
    assert finished[0]["losses"] == pytest.approx(list(trial.losses), rel=1e-5)
