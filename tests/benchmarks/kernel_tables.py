"""Derive the GEMM efficiency tables the performance model reads per device family from measured
kernel timings (issue 45: kernels as the base of the step-time model).

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/kernel_tables.py [SHARED_KERNELS_DIR]

Reads ``data/kernels/gemm.csv``, ``attention.csv`` and ``flash_attention.csv`` (the rows the project
carries, copied from the shared kernel tables with their sources and licenses: data/kernels/README.md;
a folder given instead writes those copies first) and writes ``pipette/kernel_tables.py``:
* per family, the median achieved fraction of the data-sheet peak of the bf16/fp16 GEMMs in each
  half-decade of FLOPs (2 M N K batch). Kept: plain GEMMs of real model shapes and square sweeps
  (Vidur's A100/H100 forward linears, XLA's H100/B200 tables, SimuMax's B200 Transformer Engine
  GEMMs); not batched or grouped GEMMs, not rows marked SUSPECT;
* per GPU, the median fraction of the bf16 peak cuDNN's fused causal attention reaches forward and
  backward (head size 128, sequences of 4k and more: the training regime), as FlashAttention counts
  its FLOPs (cudnn-frontend's training benchmarks on H200, B200, GB200, GB300);
* per family and head size, how much faster FlashAttention-2 (forward + backward) runs without the
  causal mask than with it, ``(sequence, full rate / causal rate)`` at each sequence timed both ways
  (issue 48: the unmasked steps of PyTorch's ring attention, ``pipette.perf_cp``);
* per family and head size, FlashAttention-2's causal forward + backward rate as a fraction of the
  family's bf16 peak, ``(sequence, fraction)``: what PyTorch's SDPA (its flash backend) runs under the
  Hugging Face models of the pipette and hf-deepspeed stacks (``PerfConstants.flash_attention_rates``);
  its README's A100 and H100 charts, and SDPA's flash backend on a B200 (cudnn-frontend's benchmark).
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRIED = REPO / "data" / "kernels" / "gemm.csv"
CARRIED_ATTENTION = REPO / "data" / "kernels" / "attention.csv"
CARRIED_FLASH = REPO / "data" / "kernels" / "flash_attention.csv"
#: the GPU names of the FlashAttention-2 timings -> the device family (pipette.efficiency.family): its README's
#: A100 and H100 benchmarks, and PyTorch SDPA's flash backend (FlashAttention-2) timed by cudnn-frontend on a B200
FLASH_FAMILIES = {"A100 80GB SXM4": "a100", "H100 80GB SXM5": "h100", "B200": "b200"}
#: the ops of those timings: FlashAttention-2 itself, and PyTorch's build of it behind SDPA
FLASH_OPS = ("flash_attn2", "sdpa_pyt_flash_attention")
#: bf16 dense peaks of the GPUs attention was timed on (pipette.device presets; H200 as the H100)
ATTENTION_PEAKS = {"H200": 989e12, "B200": 2250e12, "GB200": 2500e12, "GB300": 2500e12}
OUT = REPO / "pipette" / "kernel_tables.py"
#: the data-sheet dense bf16/fp16 peaks the fractions are of (pipette.device presets)
PEAKS = {"a100": 312e12, "h100": 989e12, "b200": 2250e12}
DTYPES = ("bf16", "fp16")
SKIP_OPS = ("bmm", "grouped_gemm_te")


def family(gpu: str) -> str | None:
    """The family of a row's GPU: the SXM parts of the presets only (not the A100 PCIe or H800)."""
    if gpu == "A100":
        return "a100"
    if gpu.startswith("H100"):
        return "h100"
    if gpu == "B200":
        return "b200"
    return None


def kept(r: dict[str, str]) -> bool:
    return (family(r["gpu"]) is not None and r["dtype"] in DTYPES and r["op"] not in SKIP_OPS
            and "SUSPECT" not in r["notes"])


def kept_attention(r: dict[str, str]) -> bool:
    return (r["gpu"] in ATTENTION_PEAKS and r["op"] == "sdpa_cudnn" and r["dtype"] == "bf16" and r["causal"] == "1"
            and r["head_dim"] == "128" and int(r["seq_q"] or 0) >= 4096)


#: the fewest tokens (batch x sequence) of a kept SDPA timing: cudnn-frontend times one sequence, which at
#: 2k tokens and less is a launch-bound kernel no training micro-batch is (FlashAttention's README keeps 16k)
FLASH_MIN_TOKENS = 4096


def kept_flash(r: dict[str, str]) -> bool:
    if r["op"] not in FLASH_OPS or r["gpu"] not in FLASH_FAMILIES or r["dtype"] not in ("fp16/bf16", "bf16"):
        return False
    if r["op"] == "flash_attn2":
        return r["pass"] == "fwd+bwd"
    return int(r["batch"] or 1) * int(r["seq_q"]) >= FLASH_MIN_TOKENS


def full_over_causal(rows: list[dict[str, str]]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """Per family and head size: (sequence, full TFLOP/s over causal TFLOP/s) where both were timed."""
    rate: dict[tuple[str, int, int], dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["pass"] == "fwd+bwd":
            rate[(FLASH_FAMILIES[r["gpu"]], int(r["head_dim"]), int(r["seq_q"]))][r["causal"]] = float(r["tflops"])
    out: dict[str, dict[int, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for (fam, d, s), by in sorted(rate.items()):
        if "0" in by and "1" in by:
            out[fam][d].append((s, by["0"] / by["1"]))
    return out


def causal_rates(rows: list[dict[str, str]]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """Per family and head size: (sequence, causal forward + backward TFLOP/s over the family's bf16 peak)."""
    out: dict[str, dict[int, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    # a forward and a backward timed apart make one rate: 3.5 forward FLOPs over their summed time
    split: dict[tuple[str, int, int], dict[str, float]] = defaultdict(dict)
    for r in sorted(rows, key=lambda r: (r["gpu"], int(r["head_dim"]), int(r["seq_q"]))):
        if r["causal"] != "1":
            continue
        fam, d, seq = FLASH_FAMILIES[r["gpu"]], int(r["head_dim"]), int(r["seq_q"])
        if r["pass"] == "fwd+bwd":
            out[fam][d].append((seq, float(r["tflops"]) * 1e12 / PEAKS[fam]))
        else:
            split[(fam, d, seq)][r["pass"]] = float(r["measured_time_s"])
            split[(fam, d, seq)][r["pass"] + "_flops"] = float(r["tflops"]) * float(r["measured_time_s"])
    for (fam, d, seq), t in sorted(split.items()):
        if "fwd" in t and "bwd" in t:
            out[fam][d].append((seq, 3.5 * t["fwd_flops"] * 1e12 / (t["fwd"] + t["bwd"]) / PEAKS[fam]))
    return out


def attention(rows: list[dict[str, str]]) -> dict[str, tuple[float, float, int]]:
    """Per GPU: (forward, backward) median fraction of the bf16 peak, and the rows."""
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by[r["gpu"]][r["pass"]].append(float(r["tflops"]) * 1e12 / ATTENTION_PEAKS[r["gpu"]])
    return {g: (sorted(p["fwd"])[len(p["fwd"]) // 2], sorted(p["bwd"])[len(p["bwd"]) // 2],
                len(p["fwd"]) + len(p["bwd"])) for g, p in by.items() if p["fwd"] and p["bwd"]}


def points(rows: list[dict[str, str]]) -> dict[str, list[tuple[float, float, int]]]:
    """Per family: (FLOPs at the bin's centre, median fraction of the peak, rows) per half-decade."""
    bins: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        fam = family(r["gpu"])
        assert fam is not None
        m, n, k, b = (float(r[c] or 1) for c in ("M", "N", "K", "batch"))
        work = 2.0 * m * n * k * b
        bins[fam][round(math.log10(work) * 2) / 2].append(work / float(r["measured_time_s"]) / PEAKS[fam])
    out = {}
    for fam, by in bins.items():
        out[fam] = [(10 ** c, sorted(v)[len(v) // 2], len(v)) for c, v in sorted(by.items()) if len(v) >= 3]
    return out


def write(tables: dict[str, list[tuple[float, float, int]]], sources: dict[str, set[str]],
          attn: dict[str, tuple[float, float, int]],
          flash: tuple[dict[str, dict[int, list[tuple[int, float]]]], set[str]],
          flash_rows: list[dict[str, str]]) -> None:
    lines = ['"""GEMM efficiency per device family from measured kernel timings: generated by',
             "tests/benchmarks/kernel_tables.py from data/kernels/gemm.csv (sources and licenses:",
             "data/kernels/README.md).",
             "",
             "Per family, (FLOPs of one GEMM, median achieved fraction of the data-sheet dense bf16/fp16 peak) per",
             "half-decade of FLOPs, bins of 3 or more timed GEMMs. Read by ``pipette.efficiency.kernel_curve``.",
             "Beside them, from data/kernels/attention.csv and flash_attention.csv: cuDNN's fused attention rates",
             "(``ATTENTION_EFFICIENCY``), FlashAttention-2's full-over-causal ratios (``FLASH_FULL_OVER_CAUSAL``)",
             "and its causal rates (``FLASH_CAUSAL_RATE``).",
             '"""', "", "from __future__ import annotations", "",
             "GEMM_EFFICIENCY: dict[str, tuple[tuple[float, float], ...]] = {"]
    for fam in sorted(tables):
        n = sum(c for _, _, c in tables[fam])
        lines.append(f"    # {fam}: {n} GEMMs from {', '.join(sorted(sources[fam]))}")
        lines.append(f'    "{fam}": (')
        lines += [f"        ({x:.3g}, {e:.3f})," for x, e, _ in tables[fam]]
        lines.append("    ),")
    lines += ["}", "",
              "#: cuDNN's fused causal attention (head size 128, sequences of 4k and more), by the GPU name it was",
              "#: timed on: (forward, backward) fraction of the bf16 peak, FLOPs as FlashAttention counts them",
              "ATTENTION_EFFICIENCY: dict[str, tuple[float, float]] = {"]
    lines += [f'    "{g}": ({f:.3f}, {b:.3f}),  # {n} timings' for g, (f, b, n) in sorted(attn.items())]
    ratios, flash_sources = flash
    lines += ["}", "",
              "#: FlashAttention-2 (forward + backward) without the causal mask against with it, per family and head",
              "#: size: (sequence, full rate / causal rate), the rates as FlashAttention counts FLOPs; read by",
              f"#: ``pipette.perf_cp`` for the ring's unmasked steps. From {', '.join(sorted(flash_sources))}",
              "FLASH_FULL_OVER_CAUSAL: dict[str, dict[int, tuple[tuple[int, float], ...]]] = {"]
    for fam in sorted(ratios):
        lines.append(f'    "{fam}": {{')
        for d in sorted(ratios[fam]):
            pts = ", ".join(f"({seq}, {x:.3f})" for seq, x in ratios[fam][d])
            lines.append(f"        {d}: ({pts}),")
        lines.append("    },")
    lines += ["}", ""]
    lines += _flash_rate_lines(causal_rates(flash_rows), {r["source"].split(":")[0] for r in flash_rows})
    OUT.write_text("\n".join(lines))


def _flash_rate_lines(rates: dict[str, dict[int, list[tuple[int, float]]]], sources: set[str]) -> list[str]:
    lines = ["#: FlashAttention-2's causal forward + backward rate, per family and head size: (sequence, fraction of",
             "#: the family's dense bf16 peak), FLOPs as FlashAttention counts them (backward 2.5x the forward); read",
             "#: by ``pipette.efficiency.flash_attention_rate`` for PyTorch SDPA's flash backend.",
             "#: From " + ", ".join(sorted(sources)),
             "FLASH_CAUSAL_RATE: dict[str, dict[int, tuple[tuple[int, float], ...]]] = {"]
    for fam in sorted(rates):
        lines.append(f'    "{fam}": {{')
        for d in sorted(rates[fam]):
            pts = [f"({seq}, {x:.3f})" for seq, x in rates[fam][d]]
            rows = [", ".join(pts[i:i + 6]) for i in range(0, len(pts), 6)]
            if len(rows) == 1:
                lines.append(f"        {d}: ({rows[0]}),")
            else:
                lines += [f"        {d}: (", *(f"            {row}," for row in rows), "        ),"]
        lines.append("    },")
    return [*lines, "}", ""]


def main() -> int:
    if len(sys.argv) > 1:
        shared = Path(sys.argv[1])
        _carry(shared / "gemm.csv", CARRIED, kept)
        _carry(shared / "attention.csv", CARRIED_ATTENTION, kept_attention)
        _carry(shared / "attention.csv", CARRIED_FLASH, kept_flash)
    with open(CARRIED, newline="") as f:
        rows = [r for r in csv.DictReader(f) if kept(r)]
    with open(CARRIED_ATTENTION, newline="") as f:
        attn = attention([r for r in csv.DictReader(f) if kept_attention(r)])
    with open(CARRIED_FLASH, newline="") as f:
        flash_rows = [r for r in csv.DictReader(f) if kept_flash(r)]
    sources: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        sources[family(r["gpu"]) or ""].add(r["source"].split(":")[0])
    tables = points(rows)
    both = {r["source"].split(":")[0] for r in flash_rows if r["pass"] == "fwd+bwd"}
    write(tables, sources, attn, (full_over_causal(flash_rows), both), flash_rows)
    for fam, pts in sorted(tables.items()):
        print(fam, " ".join(f"{x:.1e}:{e:.2f}" for x, e, _ in pts))
    for gpu, (fwd, bwd, n) in sorted(attn.items()):
        print(f"attention {gpu}: forward {fwd:.3f}, backward {bwd:.3f} of the bf16 peak ({n} timings)")
    print(f"FlashAttention-2 full over causal: {len(flash_rows)} timings")
    return 0


def _carry(source: Path, target: Path, keep: Callable[[dict[str, str]], bool]) -> None:
    """Copy the rows ``keep`` takes from the shared table, every column unchanged."""
    with open(source, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, [r for r in reader if keep(r)]
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields or []))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
