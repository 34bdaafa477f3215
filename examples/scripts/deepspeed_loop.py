#!/usr/bin/env python3
"""Train a tiny Llama with a plain DeepSpeed loop: a user's own training script as Pipette
tunes it (``pipette tune --script``).

Everything parallel comes from the DeepSpeed config (``--deepspeed_config``): micro-batch,
gradient accumulation, ZeRO stage, AutoTP (``tensor_parallel.autotp_size``) and activation
checkpointing; ``--gradient_checkpointing`` turns recomputation on. It reports to Pipette with
``pipette.report.Reporter`` (a no-op outside a Pipette trial). Launch it as any DeepSpeed
script::

    deepspeed --num_gpus 2 deepspeed_loop.py --deepspeed_config ds_config.json --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deepspeed
import torch
import torch.nn.functional as F
from common import CONFIG, Corpus, tiny_llama

from pipette.report import Reporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--model_config", default=str(CONFIG), help="a Hugging Face config.json")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    args = parser.parse_args()

    deepspeed.init_distributed()
    config = json.loads(Path(args.deepspeed_config).read_text())
    model = tiny_llama(args.model_config, seed=args.seed)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dp = engine.data_parallel_group  # AutoTP ranks of one replica read the same batch
    dp_rank = torch.distributed.get_rank(dp) if dp is not None else rank
    dp_size = torch.distributed.get_world_size(dp) if dp is not None else world
    mbs, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    data = Corpus(10**6, args.seq_len, model.config.vocab_size)

    reporter = Reporter()
    reporter.begin()
    index = dp_rank * mbs
    for step in range(args.steps):
        total = 0.0
        for _ in range(accum):
            batch = [data[i] for i in range(index, index + mbs)]
            index += mbs * dp_size
            ids = torch.stack([b["input_ids"] for b in batch]).to(engine.device)
            logits = engine(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        if rank == 0:
            print(f"step {step} loss {total / accum:.4f}", flush=True)
        if reporter.step(loss=total / accum, samples=engine.train_batch_size()):
            break
    reporter.done()
    # Leave the process group before exit: gloo's threads still running at interpreter
    # teardown abort the process ("terminate called without an active exception", status -6).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
