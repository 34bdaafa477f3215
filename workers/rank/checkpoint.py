"""A local Hugging Face checkpoint, read by slices: a rank reads only the tensors, and the rows
or columns of them, that it holds (``safetensors``' ``get_slice`` reads just those bytes).

A checkpoint is a folder with ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (what ``save_pretrained`` writes). Whether its tensors are
the model's is checked before any rank starts, without torch (``pipette.datafiles``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipette.datafiles import INDEX, SINGLE
from pipette.errors import SpecError


class Checkpoint:
    """The tensors of a checkpoint folder, by name, and their shapes (from the headers)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise SpecError(f"no checkpoint folder {str(path)!r}", field="checkpoint",
                            fix="give the local folder save_pretrained wrote (it holds config.json and *.safetensors)")
        self._open: dict[str, Any] = {}
        index = self.path / INDEX
        try:
            if index.exists():
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            elif (self.path / SINGLE).exists():
                weight_map = dict.fromkeys(self._keys(SINGLE), SINGLE)
            else:
                raise SpecError(f"{path} holds neither {SINGLE} nor {INDEX}", field="checkpoint",
                                fix="save the model with save_pretrained(..., safe_serialization=True)")
        except (OSError, ValueError, KeyError) as e:
            raise SpecError(f"cannot read the checkpoint in {path}: {type(e).__name__}: {e}", field="checkpoint",
                            fix="give a readable folder written by save_pretrained") from None
        self.files = weight_map

    def _keys(self, file: str) -> list[str]:
        return list(self._handle(file).keys())

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
            except (OSError, RuntimeError, ValueError) as e:  # safetensors raises its own error types
                raise SpecError(f"cannot read {self.path / file}: {e}", field="checkpoint",
                                fix="give a complete safetensors checkpoint") from None
        return self._open[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows x cols of tensor ``name`` (half-open ranges; all when None), read alone."""
        part = self._handle(self.files[name]).get_slice(name)
        shape = part.get_shape()
        r0, r1 = rows if rows is not None else (0, shape[0])
        if len(shape) == 1:
            out: torch.Tensor = part[r0:r1]
            return out
        c0, c1 = cols if cols is not None else (0, shape[1])
        out = part[r0:r1, c0:c1]
        return out
