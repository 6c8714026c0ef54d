"""A synthetic associative-recall task, generated on the fly: attention must find one earlier token.

Each sequence holds ``num_pairs`` *pair* tokens, each standing for a (key, value) binding, scattered among
*filler* tokens, and ends with ``num_queries`` *query* tokens, one per key to recall. The target at a
query position is the pair token that holds its key; every other position has no target. Knowing the key,
a model that does not look back can only guess among ``num_values`` pair tokens (loss log ``num_values``);
one whose attention finds the pair gets it right. A query answers from a single earlier position, so the
task works for causal and bidirectional attention alike, and its difficulty grows with the number of
fillers the pair hides among, i.e. with ``seq_len``.

Token ids: ``[0, num_keys)`` queries, then ``num_keys·num_values`` pair tokens, then fillers up to
``vocab_size``.

Batch ``i`` comes from a ``torch.Generator`` of its own, seeded from (``seed``, ``i``): the data depend on
the seed alone, never touch the global RNG, and are the same with any number of workers.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from spectral_monitor.demo.model import IGNORE_INDEX
from spectral_monitor.lightning.namespaces import pl

Task = Literal["associative_recall"]


def associative_recall_batch(
    generator: torch.Generator,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    num_keys: int,
    num_values: int,
    num_pairs: int,
    num_queries: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of the associative-recall task, drawn from ``generator`` only.

    Args:
        generator: The only source of randomness.
        batch_size: Sequences in the batch.
        seq_len: Tokens per sequence, queries included.
        vocab_size: Token ids used, fillers included.
        num_keys: Distinct keys a pair can hold.
        num_values: Distinct values a key can be bound to.
        num_pairs: Pairs hidden in each sequence (distinct keys).
        num_queries: Queries at the end of each sequence (distinct keys among the pairs).

    Returns:
        ``(tokens, targets)``, both (batch_size, seq_len) int64; a target is the pair token a query asks
        for, ``IGNORE_INDEX`` elsewhere.

    Examples:
        >>> import torch
        >>> tokens, targets = associative_recall_batch(
        ...     torch.Generator().manual_seed(0), batch_size=2, seq_len=12, vocab_size=40, num_keys=4,
        ...     num_values=2, num_pairs=2, num_queries=1,
        ... )
        >>> tokens.shape, bool((targets[:, :-1] == IGNORE_INDEX).all())
        (torch.Size([2, 12]), True)
        >>> all(bool(targets[i, -1] in tokens[i, :-1]) for i in range(2))  # the answer is in the context
        True
    """
    first_pair_token = num_keys
    first_filler_token = num_keys + num_keys * num_values
    num_fillers = vocab_size - first_filler_token
    context_len = seq_len - num_queries

    def random_subset(population: int, size: int) -> torch.Tensor:
        """``size`` distinct indices into ``range(population)`` per sequence."""
        return torch.rand(batch_size, population, generator=generator).argsort(dim=1)[:, :size]

    keys = random_subset(num_keys, num_pairs)
    values = torch.randint(num_values, (batch_size, num_pairs), generator=generator)
    pair_tokens = first_pair_token + keys * num_values + values

    context = first_filler_token + torch.randint(num_fillers, (batch_size, context_len), generator=generator)
    context.scatter_(1, random_subset(context_len, num_pairs), pair_tokens)

    asked = random_subset(num_pairs, num_queries)
    queries = keys.gather(1, asked)
    answers = pair_tokens.gather(1, asked)

    tokens = torch.cat([context, queries], dim=1)
    targets = torch.cat([torch.full_like(context, IGNORE_INDEX), answers], dim=1)
    return tokens, targets


class _SeededBatches(Dataset):
    """``num_batches`` whole batches; batch ``i`` is a pure function of (seed, i)."""

    def __init__(self, num_batches: int, seed: int, **batch_args: int) -> None:
        self.num_batches = num_batches
        self.seed = seed
        self.batch_args = batch_args

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_batches:
            raise IndexError(index)
        # torch's CPU generator keeps only 32 bits of its seed, so (seed, index) are mixed into 32 well-spread
        # bits rather than packed side by side.
        batch_seed = int(np.random.SeedSequence((self.seed, index)).generate_state(1)[0])
        generator = torch.Generator().manual_seed(batch_seed)
        return associative_recall_batch(generator, **self.batch_args)


class SyntheticDataMixin:
    """Batches of a synthetic recall task, made on the fly from the seed; nothing is downloaded.

    Args:
        task: the task; ``"associative_recall"`` (see the module docstring).
        vocab_size: token ids used; at least ``num_keys·(1 + num_values) + 1`` (one filler or more).
            Give the model the same value.
        seq_len: tokens per sequence, queries included.
        batch_size: sequences per batch.
        num_batches: batches per epoch; an epoch replays the same batches.
        seed: seed of the data (batch i is drawn from a generator seeded from (seed, i)).
        num_workers: DataLoader worker processes.
        num_keys: distinct keys a pair can hold.
        num_values: distinct values a key can be bound to.
        num_pairs: pairs hidden in each sequence (distinct keys).
        num_queries: queries at the end of each sequence (distinct keys among the pairs).

    Everything of the demo data but its Lightning base: :class:`SyntheticDataModule` adds
    ``pytorch_lightning.LightningDataModule``,
    :class:`spectral_monitor.demo.lightning_pytorch.SyntheticDataModule` ``lightning.pytorch``'s.

    Raises:
        ValueError: ``task`` is not a known task, a count is below 1 (``seed``, ``num_workers`` below 0),
            there are more pairs than keys or more queries than pairs, or ``seq_len`` or ``vocab_size``
            is too small to hold them.

    Examples:
        >>> data = SyntheticDataModule(seq_len=16, batch_size=2, num_batches=3)
        >>> tokens, targets = next(iter(data.train_dataloader()))
        >>> tokens.shape, len(data.train_dataloader())
        (torch.Size([2, 16]), 3)
    """

    def __init__(
        self,
        task: Task = "associative_recall",
        vocab_size: int = 160,
        seq_len: int = 64,
        batch_size: int = 32,
        num_batches: int = 300,
        seed: int = 0,
        num_workers: int = 0,
        num_keys: int = 16,
        num_values: int = 8,
        num_pairs: int = 8,
        num_queries: int = 4,
    ) -> None:
        super().__init__()
        if task not in get_args(Task):
            raise ValueError(f"task must be one of {get_args(Task)}, got {task!r}")
        for name, value in (
            ("seq_len", seq_len),
            ("batch_size", batch_size),
            ("num_batches", num_batches),
            ("num_keys", num_keys),
            ("num_values", num_values),
            ("num_pairs", num_pairs),
            ("num_queries", num_queries),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers!r}")
        if num_pairs > num_keys:
            raise ValueError(f"num_pairs must be <= num_keys={num_keys} (distinct keys), got {num_pairs!r}")
        if num_queries > num_pairs:
            raise ValueError(f"num_queries must be <= num_pairs={num_pairs}, got {num_queries!r}")
        if seq_len < num_pairs + num_queries:
            raise ValueError(
                f"seq_len must be >= num_pairs + num_queries = {num_pairs + num_queries}, got {seq_len!r}"
            )
        smallest_vocab = num_keys * (1 + num_values) + 1
        if vocab_size < smallest_vocab:
            raise ValueError(
                f"vocab_size must be >= num_keys·(1 + num_values) + 1 = {smallest_vocab}, got {vocab_size!r}"
            )
        self.save_hyperparameters()
        self.num_workers = num_workers
        self.train_batches = _SeededBatches(
            num_batches,
            seed,
            batch_size=batch_size,
            seq_len=seq_len,
            vocab_size=vocab_size,
            num_keys=num_keys,
            num_values=num_values,
            num_pairs=num_pairs,
            num_queries=num_queries,
        )

    def train_dataloader(self) -> DataLoader:
        """The training batches.

        Returns:
            A loader of the epoch's batches, in the same order every epoch.
        """
        # Each item is already a whole batch: no re-batching, no shuffling (order is part of the seed). The
        # loader draws a base seed for its workers on every epoch; a generator of its own keeps that draw
        # off the global RNG too.
        return DataLoader(
            self.train_batches,
            batch_size=None,
            shuffle=False,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )


class SyntheticDataModule(SyntheticDataMixin, pl.LightningDataModule):
    """:class:`SyntheticDataMixin` (arguments in its docstring) as a ``pytorch_lightning`` data module, or a
    ``lightning.pytorch`` one where only that is installed; for ``lightning.pytorch`` next to
    ``pytorch_lightning``, :class:`spectral_monitor.demo.lightning_pytorch.SyntheticDataModule`.

    Examples:
        >>> data = SyntheticDataModule(seq_len=16, batch_size=2, num_batches=3)
        >>> [part.shape for part in next(iter(data.train_dataloader()))]
        [torch.Size([2, 16]), torch.Size([2, 16])]
    """
