"""A job's input files, checked before any rank starts and without torch: a JSONL data file
(``jsonl_token_ids``) and a local Hugging Face checkpoint folder (``check_checkpoint``).

The command line, the service and the trial executors all check inputs here; the ranks then
read the same files with torch (``workers.rank.data``, ``workers.rank.checkpoint``). A
safetensors file starts with an 8-byte little-endian header length and a JSON header naming
every tensor's dtype and shape, so a checkpoint's shapes are read without loading a tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pipette.errors import SpecError
from pipette.model import ModelSpec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SAME_MODEL = "give the checkpoint of this model, or the model spec of this checkpoint"


def jsonl_token_ids(path: str, vocab: int, seq_len: int) -> list[int]:
    """The byte tokens of a JSONL of prompt/response pairs; refuses, in one line naming the file
    and the line, what cannot be read or is too short for one sequence."""
    file = Path(path)
    if not file.is_file():
        raise SpecError(f"no data file {path!r}", field="data", fix="give a local JSONL path")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read {path!r} ({e})", field="data", fix="give a readable UTF-8 JSONL file") from None
    ids: list[int] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} line {n} is not JSON ({e.msg})", field="data",
                            fix="one JSON object per line") from None
        if not isinstance(row, dict):
            raise SpecError(f"{path} line {n} is not a JSON object", field="data",
                            fix='write {"input": ..., "output": ...} per line')
        text_ = str(row.get("input", row.get("prompt", ""))) + "\n" + str(row.get("output", row.get("response", "")))
        ids.extend(b % vocab for b in text_.encode())
        ids.append(0)
    if len(ids) < seq_len + 1:
        raise SpecError(f"{path} holds {len(ids)} tokens, fewer than one sequence of {seq_len + 1}", field="data",
                        fix="give more text, or a shorter --seq-len")
    return ids


def llama_tensor_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of Hugging Face's ``LlamaForCausalLM`` for ``model`` and its shape, in
    its order (``lm_head.weight`` only when the embedding is not tied: a tied save omits it)."""
    if model.arch != "llama":
        raise SpecError(f"the trial runner builds Llama models, not {model.arch!r}",
                        field="model.arch", fix="use a Llama-architecture model (arch: llama)")
    h, q, kv, ffn = model.hidden, model.heads * model.head_dim, model.kv_dim, model.ffn_hidden
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (model.vocab, h)}
    for i in range(model.layers):
        layer = f"model.layers.{i}"
        shapes |= {f"{layer}.self_attn.q_proj.weight": (q, h), f"{layer}.self_attn.k_proj.weight": (kv, h),
                   f"{layer}.self_attn.v_proj.weight": (kv, h), f"{layer}.self_attn.o_proj.weight": (h, q),
                   f"{layer}.mlp.gate_proj.weight": (ffn, h), f"{layer}.mlp.up_proj.weight": (ffn, h),
                   f"{layer}.mlp.down_proj.weight": (h, ffn), f"{layer}.input_layernorm.weight": (h,),
                   f"{layer}.post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not model.tied_embeddings:
        shapes["lm_head.weight"] = (model.vocab, h)
    return shapes


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint folder ``path`` and its shape, from the files' headers."""
    folder = Path(path)
    if not folder.is_dir():
        raise SpecError(f"no checkpoint folder {str(path)!r}", field="checkpoint",
                        fix="give the local folder save_pretrained wrote (it holds config.json and *.safetensors)")
    try:
        if (folder / INDEX).exists():
            files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        elif (folder / SINGLE).exists():
            files = [SINGLE]
        else:
            raise SpecError(f"{path} holds neither {SINGLE} nor {INDEX}", field="checkpoint",
                            fix="save the model with save_pretrained(..., safe_serialization=True)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecError(f"cannot read the checkpoint in {path}: {type(e).__name__}: {e}", field="checkpoint",
                        fix="give a readable folder written by save_pretrained") from None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes |= _safetensors_shapes(folder / file)
    return shapes


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes in one safetensors file: its header, read alone."""
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        return {name: tuple(int(d) for d in meta["shape"]) for name, meta in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise SpecError(f"cannot read {file}: {type(e).__name__}: {e}", field="checkpoint",
                        fix="give a complete safetensors checkpoint") from None


def check_checkpoint(model: ModelSpec, path: str | Path) -> None:
    """Refuse a checkpoint whose tensors are not the model's: the first missing tensor or the
    first shape that differs, with both shapes. Reads the files' headers only."""
    have = checkpoint_shapes(path)
    for name, need in llama_tensor_shapes(model).items():
        if name not in have:
            raise SpecError(f"{path} has no tensor {name!r} (the model {model.name} needs it)", field="checkpoint",
                            fix=_SAME_MODEL)
        if have[name] != need:
            raise SpecError(f"{path}: tensor {name!r} is {list(have[name])}, the model {model.name} needs {list(need)}",
                            field="checkpoint", fix=_SAME_MODEL)
