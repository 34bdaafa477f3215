"""Training batches: synthetic learnable tokens, or a local JSONL of prompt/response pairs.

The synthetic task is one fixed cycle of ``PERIOD`` distinct tokens (spread over the
vocabulary by a permutation seeded with the vocabulary size), repeated, each sample at a
random phase. The next token is a fixed function of the current one, over few tokens, so
it is learnable in a few dozen steps by full fine-tuning and by LoRA alike: a model that
trains goes from ``ln V`` (6.2 nats for V = 512) through ``ln PERIOD`` (2.8 nats: only the
cycle's tokens, not yet their order) towards zero. A run that does not train (frozen
adapters, a broken optimizer) stays near ``ln V``. Batches depend only on (seed, step,
micro-batch, dp index), so the ranks of a tensor- or pipeline-parallel group see
identical data, as they must.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pipette.datafiles import jsonl_token_ids

#: Length of the synthetic cycle (fewer when the vocabulary is smaller).
PERIOD = 16


def synthetic_cycle(vocab: int) -> torch.Tensor:
    """The task's cycle: ``min(PERIOD, vocab)`` distinct tokens, the same for every batch."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(vocab))[: min(PERIOD, vocab)]


def synthetic_batch(vocab: int, seq_len: int, mbs: int, seed: int) -> torch.Tensor:
    """``mbs`` rows of ``seq_len + 1`` tokens of the cycle, each from a random phase."""
    cycle = synthetic_cycle(vocab)
    phase = torch.randint(0, len(cycle), (mbs, 1), generator=torch.Generator().manual_seed(seed))
    return cycle[(phase + torch.arange(seq_len + 1)) % len(cycle)]


def packed_jsonl(path: str, vocab: int, seq_len: int) -> torch.Tensor:
    """Prompt/response pairs (``{"input": ..., "output": ...}`` as in SCROLLS GovReport, or
    ``prompt``/``response``), byte-tokenized modulo the vocabulary and packed into rows."""
    ids = jsonl_token_ids(path, vocab, seq_len)
    rows = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: rows * (seq_len + 1)]).view(rows, seq_len + 1)


class Batches:
    """Micro-batches of (input_ids, labels) for one data-parallel replica."""

    def __init__(self, vocab: int, seq_len: int, mbs: int, dp_index: int, seed: int = 0, data: str | None = None):
        self.vocab, self.seq_len, self.mbs, self.dp_index, self.seed = vocab, seq_len, mbs, dp_index, seed
        self.rows = packed_jsonl(data, vocab, seq_len) if data else None
        self.count = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = self.seed * 1_000_003 + self.count * 1009 + self.dp_index
        self.count += 1
        if self.rows is None:
            tokens = synthetic_batch(self.vocab, self.seq_len, self.mbs, key)
        else:
            g = torch.Generator().manual_seed(key)
            tokens = self.rows[torch.randint(0, self.rows.shape[0], (self.mbs,), generator=g)]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next()
