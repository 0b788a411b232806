"""Packed next-token sequences from a Corpus, sharded by stage-0 replica.

Documents are tokenized, joined with the eos token into one stream, and cut into windows of
seq_len + 1 tokens: inputs = window[:-1], labels = window[1:], advancing by seq_len + 1 (as the
reference loader). Sharding uses `datasets.distributed.split_dataset_by_node`: whole files when
the file count divides by the number of shards (C4's 1024 files), else every k-th document.
A document goes to the validation split when crc32(text) % 1000 < 1000 * holdout_fraction, which
is stable under any sharding.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from noloco_node.config import NodeConfig
from noloco_node.data.corpus import Corpus
from noloco_node.errors import DataError


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSpec:
    shard_index: int = 0
    num_shards: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index {self.shard_index} is outside 0..{self.num_shards - 1}")


def is_validation(text: str, holdout_fraction: float) -> bool:
    return zlib.crc32(text.encode("utf-8")) % 1000 < round(1000 * holdout_fraction)


class PackedSequences:
    """Endless iterator over (inputs [seq_len], labels [seq_len]) int64 pairs of one shard.

    `split="train"` cycles over the shard forever (epoch e reshuffles with seed + e);
    `split="validation"` yields each held-out window once, in a fixed order.
    """

    def __init__(
        self,
        corpus: Corpus,
        tokenizer,
        *,
        seq_len: int,
        shard: ShardSpec = ShardSpec(),
        split: str = "train",
        holdout_fraction: float = 0.02,
        seed: int = 0,
        shuffle_buffer: int = 1000,
    ) -> None:
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        self.corpus, self.tokenizer, self.seq_len = corpus, tokenizer, seq_len
        self.shard, self.split, self.holdout = shard, split, holdout_fraction
        self.seed, self.shuffle_buffer = seed, shuffle_buffer
        self.epoch = 0

    def _documents(self, epoch: int) -> Iterator[str]:
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        kwargs = {"sample_by": "paragraph"} if self.corpus.format == "text" else {}
        ds = load_dataset(
            self.corpus.format, data_files=list(self.corpus.files), split="train", streaming=True, **kwargs
        )
        ds = split_dataset_by_node(ds, rank=self.shard.shard_index, world_size=self.shard.num_shards)
        if self.split == "train" and self.shuffle_buffer > 1:
            ds = ds.shuffle(seed=self.seed + epoch, buffer_size=self.shuffle_buffer)
        want_validation = self.split == "validation"
        for row in ds:
            text = row.get(self.corpus.text_field)
            if text and is_validation(text, self.holdout) == want_validation:
                yield text

    def _windows(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        eos = self.tokenizer.eos_token_id
        window = self.seq_len + 1
        buffer: list[int] = []
        batch: list[str] = []

        def flush() -> Iterator[tuple[Tensor, Tensor]]:
            nonlocal buffer
            for ids in self.tokenizer(batch, add_special_tokens=False)["input_ids"]:
                buffer.extend(ids)
                buffer.append(eos)
            batch.clear()
            while len(buffer) >= window:
                chunk = torch.tensor(buffer[:window], dtype=torch.int64)
                buffer = buffer[window:]
                yield chunk[:-1], chunk[1:]

        for text in self._documents(epoch):
            batch.append(text)
            if len(batch) >= 64:
                yield from flush()
        yield from flush()

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self.split == "validation":
            yield from self._windows(0)
            return
        while True:
            produced = False
            for pair in self._windows(self.epoch):
                produced = True
                yield pair
            if not produced:
                raise DataError(
                    f"data: shard {self.shard.shard_index}/{self.shard.num_shards} of {self.corpus.name} "
                    f"holds fewer than {self.seq_len + 1} tokens; use more data or a shorter model.seq_len"
                )
            self.epoch += 1

    def batches(self, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Stack consecutive windows into ([batch_size, seq_len], [batch_size, seq_len])."""
        pending_inputs, pending_labels = [], []
        for inputs, labels in self:
            pending_inputs.append(inputs)
            pending_labels.append(labels)
            if len(pending_inputs) == batch_size:
                yield torch.stack(pending_inputs), torch.stack(pending_labels)
                pending_inputs, pending_labels = [], []
        if pending_inputs:
            yield torch.stack(pending_inputs), torch.stack(pending_labels)


def training_batches(
    config: NodeConfig, corpus: Corpus, tokenizer, shard: ShardSpec
) -> Iterator[tuple[Tensor, Tensor]]:
    """The batches a stage-0 replica trains on: its `shard` of the run's corpus, packed into
    model.seq_len windows and stacked pipeline.batch_size at a time, shuffled unless
    pipeline.deterministic."""
    packed = PackedSequences(
        corpus,
        tokenizer,
        seq_len=config.model.seq_len,
        shard=shard,
        holdout_fraction=config.data.holdout_fraction,
        seed=config.run.seed,
        shuffle_buffer=0 if config.pipeline.deterministic else 1000,
    )
    return packed.batches(config.pipeline.batch_size)
