"""The step's global batch, cut into this replica's micro-batches.

``workers.rank.data.Batches`` draws each replica's micro-batch from (seed, micro-batch count, dp
index), so two candidates with different dp or mbs train on different tokens. Here the rows of
step ``k`` are drawn once for the whole global batch (from the seed and ``k`` only), and data-
parallel replica ``d`` takes rows ``d * per .. (d + 1) * per`` of them (``per = global / dp``),
in micro-batches of ``mbs`` rows: every candidate of a job sees the same tokens in the same
step, so their losses can be compared to a single device's.

Under context parallelism the replica index leaves out the cp coordinate (every cp rank of a
replica reads the same rows), and ``part`` keeps this cp rank's tokens of each row: the labels are
shifted on the whole sequence first, so each token keeps its own next token whichever rank holds it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.rank.data import packed_jsonl, synthetic_batch


class GlobalBatches:
    """This replica's rows of each step's global batch, as (input_ids, labels)."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, dp: int, dp_index: int, seed: int = 0,
                 data: str | None = None, part: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if global_batch % dp:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed
        self.per = global_batch // dp
        self.first = dp_index * self.per
        self.rows = packed_jsonl(data, vocab, seq_len) if data else None
        #: this rank's part of a row's tokens (``ContextParallel.shard``); None: all of them
        self.part = part
        self.step = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's rows for this replica: ``per`` rows of ``seq_len`` tokens each."""
        key = self.seed * 1_000_003 + self.step * 1009
        self.step += 1
        if self.rows is None:
            tokens = synthetic_batch(self.vocab, self.seq_len, self.global_batch, key)
        else:
            g = torch.Generator().manual_seed(key)
            tokens = self.rows[torch.randint(0, self.rows.shape[0], (self.global_batch,), generator=g)]
        mine = tokens[self.first : self.first + self.per]
        ids, labels = mine[:, :-1], mine[:, 1:]
        if self.part is not None:
            ids, labels = self.part(ids), self.part(labels)
        return ids.contiguous(), labels.contiguous()


def micro_batches(ids: torch.Tensor, labels: torch.Tensor, mbs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The replica's rows in micro-batches of ``mbs`` rows (what the pipeline schedule cuts too)."""
    return list(zip(torch.split(ids, mbs), torch.split(labels, mbs), strict=True))
