"""The grouped-GEMM curve of the MoE step time (``pipette.perf_moe``), refitted from the data.

An expert's GEMM has M = tokens routed to it (T k / E) rows: small M runs far below the dense
curve. SimuMax's 108 measured B200 bf16 Transformer Engine grouped GEMMs
(``data/kernels/grouped_gemm.csv``) give the achieved fraction of the 2,250 TFLOP/s peak against M;
``share x M / (M + half)`` is fitted by least squares (scipy ``curve_fit``)::

    .venv/bin/python tests/benchmarks/grouped_gemm_fit.py

prints the fit, its rows and the shipped ``DEFAULT_MOE.grouped_half_tokens`` beside it.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import curve_fit

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "kernels" / "grouped_gemm.csv"
#: SimuMax's B200 bf16 peak, which its efficiencies are fractions of (the rows' notes)
PEAK_TFLOPS = 2250.0


def fit(path: Path = DATA) -> tuple[float, float, int]:
    """(share, half_tokens, rows) of ``share * M / (M + half_tokens)`` over the file's rows."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    m = np.array([float(r["M"]) for r in rows])
    eff = np.array([float(r["tflops"]) / PEAK_TFLOPS for r in rows])
    (share, half), _ = curve_fit(lambda x, a, h: a * x / (x + h), m, eff, p0=(0.5, 200.0))
    return float(share), float(half), len(rows)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from pipette.perf_moe import DEFAULT_MOE

    share, half, n = fit()
    print(f"{n} grouped GEMMs ({DATA.relative_to(ROOT)}): {share:.3f} M / (M + {half:.1f}) of the peak; "
          f"shipped grouped_half_tokens {DEFAULT_MOE.grouped_half_tokens:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
