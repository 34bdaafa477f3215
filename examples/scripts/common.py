"""What both example scripts share: the tiny Llama they build locally (nothing downloaded)
and a learnable synthetic corpus, so a short run shows the loss fall."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "tiny-llama" / "config.json"


def tiny_llama(config_path: str | Path = CONFIG, seed: int = 0) -> torch.nn.Module:
    """A Llama with seeded random weights, from a Hugging Face config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in json.loads(Path(config_path).read_text()).items()
                            if not k.startswith("_") and k != "architectures"})
    return LlamaForCausalLM(config)


#: The corpus uses this many tokens of the vocabulary: a short run learns that first.
ALPHABET = 64


def sequence(index: int, seq_len: int, vocab: int) -> list[int]:
    """Sequence ``index`` of the corpus: an arithmetic progression over ``ALPHABET`` tokens (its
    start and stride from the index), so every next token follows from the two before it."""
    size = min(ALPHABET, vocab)
    start, stride = (index * 7919) % size, 1 + (index * 104729) % 13
    return [(start + stride * j) % size for j in range(seq_len)]


class Corpus(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, size: int, seq_len: int, vocab: int) -> None:
        self.size, self.seq_len, self.vocab = size, seq_len, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(sequence(index, self.seq_len, self.vocab))
        return {"input_ids": ids, "labels": ids.clone()}


def deepspeed_on_cpu() -> dict[str, bool]:
    """On a machine without a GPU, set up Accelerate's state for DeepSpeed over gloo; returns
    the ``accelerator_config`` the ``TrainingArguments`` then need (empty on a GPU).

    Accelerate (1.15) runs DeepSpeed only on an accelerator: on CPU it finds no backend, so
    the Trainer sees one process, and with ``use_cpu`` it drops DeepSpeed silently. DeepSpeed
    itself trains on CPU with gloo (``DS_ACCELERATOR=cpu``), which is how Pipette's CPU
    devices run, so a CPU run configures the state itself."""
    import os

    if torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        return {}
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what TrainingArguments sets for a --deepspeed run
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"use_configured_state": True}


def trainer_on_cpu(stack: str, accelerator_config: Path) -> list[str]:
    """On a machine without a GPU, the flags an HF Trainer run needs for ``stack``
    (``deepspeed``, ``fsdp``: the Trainer's ``--fsdp``, or ``ddp``: neither), with Accelerate's
    state set up first where that stack needs it; none on a GPU or outside a launch.

    DeepSpeed (``deepspeed_on_cpu``) and FSDP (``fsdp_on_cpu``) need the state set up before
    ``TrainingArguments`` and the Trainer told to keep it (``--accelerator_config`` with
    ``use_configured_state: true``): otherwise the Trainer resets it, and on CPU Accelerate finds
    no accelerator (``DistributedType.NO``): each rank trains alone, without DeepSpeed or FSDP.
    DDP is Accelerate's own ``MULTI_CPU`` (``--use_cpu``)."""
    import os

    if torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        return []
    if stack == "ddp":
        return ["--use_cpu"]
    if stack == "deepspeed":
        deepspeed_on_cpu()
    else:
        os.environ["ACCELERATE_USE_FSDP"] = "true"  # what TrainingArguments set for --fsdp, read by fsdp_on_cpu
        fsdp_on_cpu()
    return ["--accelerator_config", str(accelerator_config)]


def fsdp_on_cpu() -> None:
    """On a machine without a GPU, set up Accelerate's state so that its FSDP plugin shards
    the model over gloo, as on GPUs; a no-op on a GPU and outside a launch.

    Accelerate (1.15) turns FSDP on only for an accelerator (``AcceleratorState``: the
    ``MULTI_GPU``-like types become ``FSDP``); on CPU each rank sees one process and trains
    alone, and a CPU run with ``use_cpu`` is ``MULTI_CPU``, which drops the plugin silently.
    FSDP2 itself shards on CPU over gloo (reduce-scatter and all-gather), so a CPU run joins the
    ranks over gloo and takes Accelerate's multi-device path, whose FSDP branch builds the plugin
    from what ``accelerate launch`` exported."""
    import os

    if torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        return
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(backend="gloo")  # joins the ranks (distributed_type NO: no accelerator found)
    state.distributed_type = DistributedType.MULTI_GPU  # read once, by AcceleratorState's FSDP branch
