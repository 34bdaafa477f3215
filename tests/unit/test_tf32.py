"""TF32 (``dtype: tf32``): fp32 training with its matmuls on TF32 tensor cores.

What it changes, each checked where a wrong answer would show: the device peaks it is priced at
(and the fallback to fp32 where a device has no TF32 tensor cores), the memory (fp32's), the GEMM
curve read at the bf16 GEMM of the same duration, the files Pipette writes (no mixed-precision
section; the Trainer's ``--tf32`` only on a GPU; a note where a script or framework must switch it
on itself) and the rank's matmul precision (GPU-only code, checked here without a GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.emit import deepspeed_config
from pipette.emit_frameworks import megatron_args_file, nanotron_config
from pipette.emit_script import write_script_launch_files
from pipette.errors import SpecError
from pipette.memory import estimate_memory
from pipette.model import ModelSpec
from pipette.perf import PerfModel, _curve_scale, estimate_perf
from pipette.script import ScriptSpec
from pipette.stacks import get_stack
from pipette.training import TrainingSpec
from service.schemas import TrainingIn
from service.specs import training_spec
from workers.fsdp_spec import plan_for
from workers.rank.devices import set_matmul_precision
from workers.rank.hf_model import TORCH_DTYPES

MODEL = ModelSpec.preset("llama3.2-1b")
CONFIG = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=16, zero_stage=1, recompute="full")


def job(dtype: str) -> TrainingSpec:
    return TrainingSpec(global_batch=16, seq_len=2048, dtype=dtype)  # type: ignore[arg-type]


def step(device: str, dtype: str, stack: str = "pipette") -> float:
    cluster = homogeneous_cluster(device, 1, 8, 300e9, 25e9, name="one-node")
    return estimate_perf(MODEL, job(dtype), CONFIG, cluster, stack=get_stack(stack)).step_time


@pytest.mark.parametrize(("name", "tf32"), [
    ("A100-40GB", 156e12), ("A100-80GB", 156e12), ("H100-80GB", 494.5e12), ("H200-141GB", 494.5e12),
    ("GH200-96GB", 494.5e12), ("GH200-144GB", 494.5e12), ("B200-180GB", 1100e12),
])
def test_presets_carry_the_dense_tf32_peak(name: str, tf32: float) -> None:
    d = DeviceSpec.preset(name)
    assert d.peak("tf32") == tf32 and d.peak("fp32") < tf32 < d.peak("bf16")


@pytest.mark.parametrize("name", ["V100-32GB", "T4-16GB", "cpu"])
def test_a_device_without_tf32_tensor_cores_runs_it_as_fp32(name: str) -> None:
    d = DeviceSpec.preset(name)
    assert "tf32" not in d.peak_flops and d.peak("tf32") == d.peak("fp32")
    assert _curve_scale(d, "tf32") == 1.0


def test_the_recipe_takes_tf32_as_fp32_storage_without_mixed_precision() -> None:
    t = job("tf32")
    assert (t.dtype_bytes, t.mixed_precision) == (4, False)
    assert (job("bf16").mixed_precision, job("fp32").mixed_precision) == (True, False)
    with pytest.raises(SpecError) as e:
        job("tf16")
    assert "tf32" in str(e.value)


@pytest.mark.parametrize("stack", ["pipette", "megatron", "fsdp"])
def test_tf32_holds_fp32s_memory(stack: str) -> None:
    options = get_stack(stack).memory_options
    fp32 = estimate_memory(MODEL, job("fp32"), CONFIG, 80 * 2**30, options=options)
    tf32 = estimate_memory(MODEL, job("tf32"), CONFIG, 80 * 2**30, options=options)
    bf16 = estimate_memory(MODEL, job("bf16"), CONFIG, 80 * 2**30, options=options)
    assert (tf32.live_bytes, tf32.reserved_bytes) == (fp32.live_bytes, fp32.reserved_bytes)
    assert tf32.breakdown == fp32.breakdown and tf32.live_bytes != bf16.live_bytes


@pytest.mark.parametrize("device", ["A100-80GB", "H100-80GB", "B200-180GB"])
def test_tf32_is_priced_between_bf16_and_fp32(device: str) -> None:
    bf16, tf32, fp32 = step(device, "bf16"), step(device, "tf32"), step(device, "fp32")
    assert bf16 < tf32 < fp32
    # the GEMMs run at half bf16's peak (a fifth on B200), read on the curve at the bf16 GEMM of the
    # same duration, so TF32 costs less than the peak ratio alone would say
    assert tf32 / bf16 < DeviceSpec.preset(device).peak("bf16") / DeviceSpec.preset(device).peak("tf32")


def test_the_curve_is_read_at_the_bf16_gemm_of_the_same_duration() -> None:
    h100 = DeviceSpec.preset("H100-80GB")
    assert _curve_scale(h100, "tf32") == pytest.approx(989 / 494.5)
    assert _curve_scale(h100, "fp32") == _curve_scale(h100, "bf16") == 1.0
    cluster = homogeneous_cluster("H100-80GB", 1, 8, 300e9, 25e9, name="one-node")
    model = PerfModel(MODEL, job("tf32"), CONFIG, cluster)
    flops = 2.0 * 4096 * 2048 * 2048
    expected = flops / (494.5e12 * float(model.curve(flops * 2.0)))
    assert model.kernels.gemm_time(flops, 1) == pytest.approx(expected)


@pytest.mark.parametrize("device", ["V100-32GB", "cpu"])
def test_without_tf32_tensor_cores_tf32_is_priced_as_fp32(device: str) -> None:
    assert step(device, "tf32") == step(device, "fp32")


def test_the_deepspeed_config_of_tf32_has_no_mixed_precision_section() -> None:
    ds = deepspeed_config(job("tf32"), CONFIG)
    assert "bf16" not in ds and "fp16" not in ds
    assert deepspeed_config(job("bf16"), CONFIG)["bf16"] == {"enabled": True}


HF = ScriptSpec(argv=("python", "train.py"), kind="hf-trainer")
LOOP = ScriptSpec(argv=("python", "loop.py"), kind="deepspeed")


def test_the_trainer_gets_tf32_on_a_gpu_only() -> None:
    on_gpu = HF.command(job("tf32"), CONFIG, "ds.json", device_kind="gpu")
    on_cpu = HF.command(job("tf32"), CONFIG, "ds.json", device_kind="cpu")
    assert on_gpu[-1] == "--tf32" and "--tf32" not in on_cpu
    assert "--tf32" not in HF.command(job("fp32"), CONFIG, "ds.json", device_kind="gpu")
    assert "--bf16" not in on_gpu and "--fp16" not in on_gpu


def test_a_launch_says_when_the_script_must_switch_tf32_on_itself(tmp_path: Path) -> None:
    cluster = homogeneous_cluster("A100-80GB", 1, 8, 300e9, 25e9, name="one-node")
    write_script_launch_files(tmp_path / "loop", MODEL, job("tf32"), CONFIG, cluster, LOOP)
    write_script_launch_files(tmp_path / "hf", MODEL, job("tf32"), CONFIG, cluster, HF)
    loop = (tmp_path / "loop" / "launch-torchrun.sh").read_text()
    hf = (tmp_path / "hf" / "launch-torchrun.sh").read_text()
    assert "# TF32:" in loop and 'torch.set_float32_matmul_precision(\\"high\\")' not in loop
    assert 'torch.set_float32_matmul_precision("high")' in loop
    assert "# TF32:" not in hf and " --tf32" in hf
    write_script_launch_files(tmp_path / "bf16", MODEL, job("bf16"), CONFIG, cluster, LOOP)
    assert "# TF32:" not in (tmp_path / "bf16" / "launch-torchrun.sh").read_text()


def test_megatron_and_nanotron_files_say_tf32_is_the_users_to_switch_on() -> None:
    args = megatron_args_file(job("tf32"), CONFIG, MODEL.layers, "header")
    assert "# TF32:" in args and "--bf16" not in args and "--fp16" not in args
    assert "# TF32:" not in megatron_args_file(job("bf16"), CONFIG, MODEL.layers, "header")
    assert "# TF32:" in nanotron_config(job("tf32"), CONFIG, "header")


def test_the_api_takes_tf32() -> None:
    spec = training_spec(TrainingIn(global_batch=16, seq_len=2048, dtype="tf32"))
    assert spec.dtype == "tf32" and not spec.mixed_precision


def test_the_fsdp_runner_trains_tf32_without_mixed_precision() -> None:
    tiny = ModelSpec(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                     max_seq=64, tied_embeddings=False, arch="llama")
    one = ParallelConfig(tp=1, pp=1, dp=1, mbs=2, global_batch=4, zero_stage=0)
    t = TrainingSpec(global_batch=4, seq_len=32, dtype="tf32")
    assert not plan_for(tiny, t, one).fsdp  # a single rank trains the plain model, as in fp32
    assert plan_for(tiny, TrainingSpec(global_batch=4, seq_len=32, dtype="bf16"), one).fsdp
    assert TORCH_DTYPES["tf32"] is torch.float32


@pytest.fixture
def precision() -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.usefixtures("precision")
def test_a_gpu_rank_switches_tf32_on_and_off_and_a_cpu_rank_is_left_alone() -> None:
    cuda = torch.device("cuda", 0)  # never allocated on: the setting is process-wide
    assert set_matmul_precision("tf32", cuda) == "high" and torch.get_float32_matmul_precision() == "high"
    assert set_matmul_precision("fp32", cuda) == "highest" and torch.get_float32_matmul_precision() == "highest"
    torch.set_float32_matmul_precision("medium")
    assert set_matmul_precision("tf32", torch.device("cpu")) is None
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.usefixtures("precision")
def test_the_probe_times_tf32_as_a_gpu_rank_trains_it_and_restores_the_precision() -> None:
    """The probe's TF32 figure is fp32 matmuls at ``"high"`` on a GPU (``workers.rank.probe.matmul_precision``,
    the GPU-only branch checked here without one), its fp32 at full precision; either way the process's
    precision is back as it was afterwards. On CPU devices the timing runs at the precision found."""
    from workers.rank.probe import matmul_precision

    cuda = torch.device("cuda", 0)
    torch.set_float32_matmul_precision("medium")
    for name, inside in (("tf32", "high"), ("fp32", "highest"), ("bf16", "highest")):
        with matmul_precision(name, cuda):
            assert torch.get_float32_matmul_precision() == inside
        assert torch.get_float32_matmul_precision() == "medium"
    with matmul_precision("tf32", torch.device("cpu")):
        assert torch.get_float32_matmul_precision() == "medium"
