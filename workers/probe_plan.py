"""What the probe measures (shared by the host that plans it and the rank that runs it; no torch)."""

from __future__ import annotations

from pipette.model import ModelSpec

#: the two ping-pong message sizes (bytes) a link is timed with: latency, bandwidth
SIZES = (8 * 1024, 4 * 1024 * 1024)
GPU_SIZES = (1024 * 1024, 64 * 1024 * 1024)


def message_sizes(device_kind: str) -> tuple[int, int]:
    return GPU_SIZES if device_kind == "gpu" else SIZES


def probe_shapes(device_kind: str, model: ModelSpec | None, seq_len: int) -> list[list[int]]:
    """The (m, k, n) matmuls each device times: squares that span the efficiency curve (up to
    8192 on a GPU, where smaller ones do not reach its peak), and the model's own projections
    (``seq_len`` tokens by hidden x hidden and hidden x ffn, the shapes of a micro-batch of one
    sequence)."""
    sizes = (1024, 2048, 4096, 8192) if device_kind == "gpu" else (256, 512, 1024)
    shapes = [[n, n, n] for n in sizes]
    if model is not None:
        shapes += [[seq_len, model.hidden, model.hidden], [seq_len, model.hidden, model.ffn_hidden]]
    return shapes
