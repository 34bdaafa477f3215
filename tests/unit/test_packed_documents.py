"""Packed sequences (``TrainingSpec.document_len``): fine-tuning recipes pack several samples into
each sequence, and a stack whose attention keeps to the documents (Megatron-Core's THD format,
``PerfConstants.varlen_attention``) attends over each document alone. Megatron-Bridge's LoRA and
SFT performance runs pack SQuAD this way (``packed_sequence=True``); priced as one document a
sequence, the ten were predicted 0.98-1.11x of their measured steps, 1.055 at the median
(docs/results.md, "Cross-validated step time per stack")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipette import flops
from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.perf import PerfModel
from pipette.stacks import get_stack
from pipette.training import LoraSpec, TrainingSpec
from tests.unit.test_cli import CLUSTERS, pipette

MODEL = ModelSpec.preset("llama3-70b")
CLUSTER = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9, name="h8")
CONFIG = ParallelConfig(tp=4, pp=2, dp=1, mbs=1, global_batch=32)
LORA = TrainingSpec(global_batch=32, seq_len=4096, method="lora", lora=LoraSpec(16, 32.0))


def step(training: TrainingSpec, stack: str) -> PerfModel:
    return PerfModel(MODEL, training, CONFIG, CLUSTER, constants=get_stack(stack).constants)


@pytest.mark.parametrize("bad", [0, -1, 4097, True, 2.5, "512"])
def test_a_document_length_is_a_whole_number_up_to_the_sequence(bad: object) -> None:
    with pytest.raises(SpecError) as e:
        TrainingSpec.from_dict({"global_batch": 8, "seq_len": 4096, "document_len": bad})
    assert e.value.field == "training.document_len" and "seq_len (4096)" in e.value.message


def test_an_unpacked_recipe_keeps_its_keys_and_a_packed_one_round_trips() -> None:
    assert "document_len" not in LORA.to_dict()  # the job keys of every recipe before it are unchanged
    packed = replace(LORA, document_len=256)
    assert TrainingSpec.from_dict(packed.to_dict()) == packed and packed.attention_span == 256
    assert LORA.attention_span == 4096


def test_megatron_attends_within_the_documents_and_the_runners_over_the_sequence() -> None:
    packed = replace(LORA, document_len=256)
    whole, short = step(LORA, "megatron+fp8"), step(packed, "megatron+fp8")
    assert short.compute.attention[0] == pytest.approx(whole.compute.attention[0] * 256 / 4096, rel=1e-9)
    assert 0.85 < short.step_time() / whole.step_time() < 0.99  # the attention's share of a 70B LoRA step
    for stack in ("pipette", "fsdp", "nanotron", "hf-deepspeed"):  # no document boundaries in their attention
        assert step(packed, stack).step_time() == step(LORA, stack).step_time(), stack
    # the MFU counts the attention the step computes
    f, g = flops.per_step(MODEL, LORA), flops.per_step(MODEL, LORA, span=256)
    assert g.model < f.model and short.estimate().mfu == pytest.approx(
        whole.estimate().mfu * (g.model / f.model) * (whole.step_time() / short.step_time()), rel=1e-9)


def test_the_plan_says_which_stacks_price_the_documents(tmp_path: Path) -> None:
    r = pipette("plan", "--model", "llama3-8b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"), "--global-batch", "16",
                "--seq-len", "4096", "--document-len", "512", "--stack", "megatron,fsdp", "--no-files", "--top", "1")
    assert r.returncode == 0, r.stderr
    assert "packed: documents of 512 tokens, attending within themselves" in r.stdout
    assert "fsdp attends over whole sequences (no document boundaries): priced so" in r.stdout
    assert "megatron attends over whole" not in r.stdout
    bad = pipette("plan", "--model", "llama3-8b", "--cluster", str(CLUSTERS / "a100-2x8.yaml"), "--global-batch",
                  "16", "--seq-len", "4096", "--document-len", "8192", "--no-files")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(
        "pipette: error: --document-len: must be a whole number from 1 to seq_len (4096), got 8192"), bad.stderr


def test_the_api_takes_a_document_length_and_leaves_an_unpacked_recipe_as_it_was() -> None:
    from service.schemas import TrainingIn

    packed = TrainingIn(global_batch=32, seq_len=4096, document_len=256).to_spec_dict()
    assert TrainingSpec.from_dict(packed).document_len == 256
    assert "document_len" not in TrainingIn(global_batch=32, seq_len=4096).to_spec_dict()
