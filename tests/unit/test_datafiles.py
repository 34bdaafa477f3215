"""The job's input files checked without torch (``pipette.datafiles``): a checkpoint's tensor
shapes from its safetensors headers, written here by hand as the format says."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pipette.datafiles import check_checkpoint, checkpoint_shapes, llama_tensor_shapes
from pipette.errors import SpecError
from pipette.model import ModelSpec


def _write(file: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file's header (8-byte length, JSON) with zero-size data: enough for a check
    that reads headers only."""
    header = {name: {"dtype": "F32", "shape": list(s), "data_offsets": [0, 0]} for name, s in shapes.items()}
    blob = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    file.write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_a_checkpoint_of_the_model_passes_and_another_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    tiny = ModelSpec.preset("tiny-llama")
    _write(tmp_path / "model.safetensors", llama_tensor_shapes(tiny))
    check_checkpoint(tiny, tmp_path)
    assert checkpoint_shapes(tmp_path)["model.norm.weight"] == (tiny.hidden,)
    with pytest.raises(SpecError) as e:
        check_checkpoint(ModelSpec.preset("tiny-llama-gqa"), tmp_path)
    assert "model.layers.0.self_attn.k_proj.weight" in e.value.message and "[128, 128]" in e.value.message


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path: Path) -> None:
    shapes = llama_tensor_shapes(ModelSpec.preset("tiny-llama"))
    names = list(shapes)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        _write(tmp_path / file, {n: shapes[n] for n in part})
    weight_map = {n: file for file, part in halves.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    check_checkpoint(ModelSpec.preset("tiny-llama"), tmp_path)
    del weight_map[names[-1]]
    _write(tmp_path / "b.safetensors", {n: shapes[n] for n in halves["b.safetensors"][:-1]})
    with pytest.raises(SpecError, match=f"has no tensor '{names[-1]}'"):
        check_checkpoint(ModelSpec.preset("tiny-llama"), tmp_path)


@pytest.mark.parametrize("content, words", [(None, "no checkpoint folder"), (b"", "holds neither"),
                                            (b"\x05\x00", "cannot read")])
def test_what_is_not_a_checkpoint_is_refused_in_one_line(tmp_path: Path, content: bytes | None, words: str) -> None:
    folder = tmp_path / "ckpt"
    if content is not None:
        folder.mkdir()
        if content:
            (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(SpecError, match=words):
        check_checkpoint(ModelSpec.preset("tiny-llama"), folder)


def test_the_checks_load_no_torch() -> None:
    code = ("import sys, pipette.datafiles, cli.tune; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
