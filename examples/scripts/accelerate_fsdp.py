#!/usr/bin/env python3
"""Train a tiny Llama with Accelerate's FSDP plugin: a user's own training script as Pipette
tunes it (``pipette tune --script-kind accelerate-fsdp``).

A plain Accelerate loop, as Accelerate's documentation writes one (``Accelerator``,
``prepare``, ``accumulate``, ``backward``): everything about FSDP (FSDP2, reshard after
forward, the decoder-layer wrap, activation checkpointing, CPU offload, mixed precision) comes
from the config ``accelerate launch --config_file`` reads, none of it from this file. It takes
the micro-batch, the gradient accumulation steps and the step count as flags, and reports to
Pipette with ``pipette.report.Reporter`` (a no-op outside a Pipette trial). Launch it as any
Accelerate script::

    accelerate launch --config_file accelerate_config.yaml accelerate_fsdp.py \\
        --per_device_train_batch_size 2 --gradient_accumulation_steps 1 --max_steps 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from accelerate import Accelerator
from common import CONFIG, Corpus, fsdp_on_cpu, tiny_llama
from torch.utils.data import DataLoader

from pipette.report import Reporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--model_config", default=str(CONFIG), help="a Hugging Face config.json")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    fsdp_on_cpu()  # before the Accelerator: on a CPU-only machine Accelerate would drop FSDP
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    model = tiny_llama(args.model_config, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    steps, mbs, accum = args.max_steps, args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = mbs * accum * accelerator.num_processes
    data = Corpus(steps * global_batch, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=mbs, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    reporter = Reporter()
    reporter.begin()
    model.train()
    step, total, last = 0, 0.0, time.perf_counter()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        total += loss.item() / accum
        if not accelerator.sync_gradients:
            continue
        mean = accelerator.reduce(torch.tensor(total, device=accelerator.device), reduction="mean").item()
        now = time.perf_counter()  # the step's time as Pipette's Reporter takes it: from the last step's end
        accelerator.print(f"step {step} loss {mean:.4f} time {now - last:.4f}")
        last = now
        step, total = step + 1, 0.0
        if reporter.step(loss=mean, samples=global_batch) or step >= steps:
            break
    reporter.done()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # leaves the process group: gloo's threads alive at exit abort it


if __name__ == "__main__":
    main()
