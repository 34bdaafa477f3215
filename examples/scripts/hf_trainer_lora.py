#!/usr/bin/env python3
"""Fine-tune a tiny Llama with LoRA under the Hugging Face Trainer and DeepSpeed: a user's own
training script as Pipette tunes it (``pipette tune --script``).

It takes the Trainer's own flags (``--deepspeed``, ``--per_device_train_batch_size``,
``--gradient_accumulation_steps``, ``--gradient_checkpointing``, ``--max_steps``, ...) plus
``--seq_len`` and ``--lora_rank``, and reports to Pipette with ``pipette.report.HFCallback``
(a no-op outside a Pipette trial). Launch it as any Trainer script::

    torchrun --nproc_per_node 2 hf_trainer_lora.py --deepspeed ds_config.json \\
        --per_device_train_batch_size 2 --max_steps 20 --output_dir /tmp/out
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import CONFIG, HERE, Corpus, tiny_llama, trainer_on_cpu
from peft import LoraConfig, get_peft_model
from transformers import HfArgumentParser, Trainer, TrainingArguments

from pipette.report import HFCallback


@dataclass
class ScriptArguments:
    model_config: str = field(default=str(CONFIG), metadata={"help": "a Hugging Face config.json"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    lora_rank: int = field(default=8)
    lora_alpha: float = field(default=16.0)
    samples: int = field(default=4096, metadata={"help": "sequences in the synthetic corpus"})


def main() -> None:
    argv = sys.argv[1:]
    # On CPU, Accelerate's state is set up before TrainingArguments (which set up the processes),
    # for the stack the run uses, and the Trainer told to use it (use_configured_state)
    stack = "fsdp" if "--fsdp" in argv else "deepspeed" if "--deepspeed" in argv else "ddp"
    argv += trainer_on_cpu(stack, HERE / "cpu_accelerator_config.json")
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    model = tiny_llama(script.model_config, seed=args.seed)
    model = get_peft_model(model, LoraConfig(r=script.lora_rank, lora_alpha=script.lora_alpha,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    if args.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    data = Corpus(script.samples, script.seq_len, model.config.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[HFCallback()])
    result = trainer.train()
    if args.process_index == 0:
        print(f"train_loss={result.training_loss:.4f} "
              f"train_samples_per_second={result.metrics['train_samples_per_second']:.3f}", flush=True)
    if torch.distributed.is_initialized():  # gloo's threads alive at exit abort the process
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
