"""Pipette core: specs, search space, memory estimator, performance model, placement.

Pure and deterministic; imports numpy, scipy, optuna, pydantic and yaml only (the
import rules of DESIGN.md are enforced by ``tests/unit/test_layering.py``).
"""

__version__ = "0.1.0"
