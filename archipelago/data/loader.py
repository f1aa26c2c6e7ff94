"""Deterministic, resumable batches of token windows from a prepared token file.

Window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; inputs are its first
seq_len tokens and targets the last seq_len (shifted by one). The visiting order is a
pure function of (seed, island, epoch), so every rank and island computes it
independently and no communication is needed to agree on who reads what.

Sharding across islands of different sizes and speeds: one permutation of all windows
(from the seed) is dealt round-robin into `num_islands` fixed shards; island K owns
shard K for the whole run, whatever its rank count. Each epoch an island visits its own
shard (epoch 0 in shard order, later epochs reshuffled from (seed, island, epoch)), one
global batch per step, rank r taking the r-th slice of it. So islands never read each
other's windows, ranks of one island never overlap and leave no gap, and a fast island
that finishes its shard starts its next epoch (logged) without touching a slow island's
data. The shard is the island's index, not its ranks (the reference platform's
`dp * replica_id + rank` overlaps when islands differ in size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

_DTYPES = ("uint16", "uint32")


class TokenRangeError(ValueError):
    """A token file holds ids the model has no embedding for (another tokenizer made it)."""


def _open_tokens(token_path: Path, dtype: str) -> np.ndarray:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}; use PreparedDataset.dtype")
    token_path = Path(token_path)
    if not token_path.is_file():
        raise FileNotFoundError(f"token file {token_path} not found; run prepare_dataset() first")
    itemsize = np.dtype(dtype).itemsize
    size = token_path.stat().st_size
    if size % itemsize:
        raise ValueError(f"{token_path} is {size} bytes, not a whole number of {dtype}; is dtype right?")
    if size == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses empty files
    # Read-only memmap: the OS pages in only the windows we touch, and all ranks on a
    # host share one page cache copy.
    return np.memmap(token_path, dtype=dtype, mode="r")


def _count_windows(n_tokens: int, seq_len: int) -> int:
    # Window i needs i*seq_len + seq_len + 1 <= n_tokens.
    return max(0, (n_tokens - 1) // seq_len)


def _gather(tokens: np.ndarray, windows: np.ndarray, seq_len: int, vocab_size: int | None = None,
            path: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.empty((len(windows), seq_len + 1), dtype=np.int64)
    for j, w in enumerate(windows):
        start = int(w) * seq_len
        rows[j] = tokens[start:start + seq_len + 1]  # one contiguous read per window
    # An id past the vocabulary would index past the embedding table (a crash on CPU, an
    # illegal memory access on GPU). Checking each batch costs one pass over its ids.
    if vocab_size is not None and rows.size and int(rows.max()) >= vocab_size:
        raise TokenRangeError(f"{path}: token id {int(rows.max())} is outside the vocabulary of {vocab_size} "
                              "ids; the token files were made with another tokenizer: prepare them again "
                              "(`archipelago data prepare`) with the run's --data.tokenizer")
    batch = torch.from_numpy(rows)
    # contiguous copies so callers can .view()/pin_memory() without surprises (cost: one copy).
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class ShardOrder:
    """Which items (windows, images) each rank of each island reads, step by step.

    Each epoch draws a permutation of all items from ``default_rng((seed, epoch))``.
    Island k of n takes permutation positions k, k+n, k+2n, ...; each optimizer step the
    island consumes its next ``global_batch_size`` items and rank r gets the r-th
    contiguous block of ``global_batch_size // world_size`` of them, or of ``shares[r]``
    when ranks take unequal shares (heterogeneous data parallelism). Hence the union over
    ranks equals a 1-rank run's batch, and ``state_dict`` does not depend on the rank,
    world size or shares (a run may resume with a different split).
    """

    def __init__(self, num_items: int, global_batch_size: int, rank: int, world_size: int, seed: int,
                 island: int = 0, num_islands: int = 1, what: str = "windows",
                 log: Callable[[str], None] | None = None, shares: Sequence[int] | None = None) -> None:
        _check_positive(global_batch_size=global_batch_size, world_size=world_size, num_islands=num_islands)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size}); pass this process's rank")
        if not 0 <= island < num_islands:
            raise ValueError(f"island {island} is outside [0, num_islands={num_islands}); check the island index")
        shares = _rank_shares(global_batch_size, world_size, shares)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_items, self.global_batch_size = num_items, global_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.island, self.num_islands = seed, island, num_islands
        self.local_batch_size = shares[rank]
        self.first = sum(shares[:rank])  # where this rank's block starts inside the island's batch
        self.what, self._log = what, log
        self.epoch, self.cursor = 0, 0
        self.order = self._island_order(0)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps this island takes per epoch (the remainder is dropped)."""
        return len(self.order) // self.global_batch_size

    def _island_order(self, epoch: int) -> np.ndarray:
        shard = np.random.default_rng((self.seed, 0)).permutation(self.num_items)[self.island::self.num_islands]
        if epoch == 0:
            return shard
        return shard[np.random.default_rng((self.seed, self.island, epoch)).permutation(len(shard))]

    def next_indices(self) -> np.ndarray:
        """This rank's items of the island's next step."""
        if self.cursor + self.global_batch_size > len(self.order):
            dropped = len(self.order) - self.cursor
            self.epoch, self.cursor = self.epoch + 1, 0
            self.order = self._island_order(self.epoch)
            if self._log is not None:
                self._log(f"data: island {self.island} starts epoch {self.epoch} of its own shard "
                          f"(dropped {dropped} leftover {self.what})")
        lo = self.cursor + self.first
        self.cursor += self.global_batch_size
        return self.order[lo:lo + self.local_batch_size]

    def state_dict(self) -> dict:
        """Position of the island; identical on all its ranks."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_islands": self.num_islands, "island": self.island}

    def load_state_dict(self, state: dict, source: str = "this token file") -> None:
        for name in ("global_batch_size", "seed", "num_islands", "island"):
            if state.get(name) != getattr(self, name):
                raise ValueError(
                    f"cannot resume data loader: checkpoint has {name}={state.get(name)!r} but this run has "
                    f"{name}={getattr(self, name)!r}; resuming needs the same data settings "
                    f"(seq_len, global_batch_size, seed, num_islands, island)"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        order = self._island_order(epoch)
        if epoch < 0 or cursor < 0 or cursor % self.global_batch_size or cursor > len(order):
            raise ValueError(
                f"cannot resume data loader: cursor {cursor} (epoch {epoch}) does not fit {source} "
                f"({len(order)} {self.what} for island {self.island}); resuming needs the same prepared dataset"
            )
        self.epoch, self.cursor, self.order = epoch, cursor, order


def _rank_shares(global_batch_size: int, world_size: int, shares: Sequence[int] | None) -> list[int]:
    """Samples per rank: equal blocks, or the given shares (checked: one positive share per rank, summing
    to the global batch)."""
    if shares is None:
        if global_batch_size % world_size:
            raise ValueError(f"global_batch_size {global_batch_size} is not divisible by world_size {world_size}; "
                             f"set global_batch_size to a multiple of {world_size}")
        return [global_batch_size // world_size] * world_size
    shares = [int(n) for n in shares]
    if len(shares) != world_size or min(shares) < 1 or sum(shares) != global_batch_size:
        raise ValueError(f"rank shares {shares} must give each of the {world_size} ranks at least one sample and "
                         f"sum to the global batch ({global_batch_size})")
    return shares


class TokenSequenceLoader:
    """Shuffled training batches of token windows for one rank of one island (ShardOrder)."""

    def __init__(
        self,
        token_path: Path,
        seq_len: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        island: int = 0,
        num_islands: int = 1,
        dtype: str = "uint16",
        log: Callable[[str], None] | None = None,
        vocab_size: int | None = None,
        shares: Sequence[int] | None = None,
    ) -> None:
        _check_positive(seq_len=seq_len, global_batch_size=global_batch_size,
                        world_size=world_size, num_islands=num_islands)
        self._path = Path(token_path)
        self._tokens = _open_tokens(self._path, dtype)
        self._num_windows = _count_windows(len(self._tokens), seq_len)
        per_island = self._num_windows // num_islands  # the smallest island's share
        if per_island < global_batch_size:
            raise ValueError(
                f"{self._path} has {len(self._tokens):,} tokens = {self._num_windows} windows of seq_len+1="
                f"{seq_len + 1}, i.e. {per_island} per island for {num_islands} island(s), fewer than one "
                f"global batch ({global_batch_size}); lower seq_len, global_batch_size or num_islands, "
                f"or use more data"
            )
        self._shards = ShardOrder(self._num_windows, global_batch_size, rank, world_size, seed, island,
                                  num_islands, "windows", log, shares)
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.island, self.num_islands = seed, island, num_islands
        self.local_batch_size = self._shards.local_batch_size
        self.vocab_size = vocab_size  # ids at or above it are refused (TokenRangeError)

    @property
    def num_windows(self) -> int:
        """Windows in the whole token file (all islands together)."""
        return self._num_windows

    @property
    def epoch(self) -> int:
        return self._shards.epoch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps this island takes per epoch (the remainder is dropped)."""
        return self._shards.steps_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 of shape [this rank's share of the global batch, seq_len]."""
        return _gather(self._tokens, self._shards.next_indices(), self.seq_len, self.vocab_size, self._path)

    def state_dict(self) -> dict:
        """Position of the island; identical on all its ranks."""
        return {**self._shards.state_dict(), "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len") != self.seq_len:
            raise ValueError(
                f"cannot resume data loader: checkpoint has seq_len={state.get('seq_len')!r} but this run has "
                f"seq_len={self.seq_len!r}; resuming needs the same data settings "
                "(seq_len, global_batch_size, seed, num_islands, island)"
            )
        self._shards.load_state_dict(state)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def validation_batches(
    token_path: Path,
    seq_len: int,
    batch_size: int,
    rank: int,
    world_size: int,
    max_batches: int,
    dtype: str = "uint16",
    vocab_size: int | None = None,
    offset: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic validation batches in file order (no shuffle), split across ranks.

    Batch j covers windows offset + [j*batch_size, (j+1)*batch_size); rank r gets the r-th
    contiguous block of batch_size // world_size. Yields min(max_batches, windows //
    batch_size) batches; a file with fewer than batch_size windows (but at least
    world_size) yields one smaller batch. Every rank yields the same number of batches,
    so collective ops over the results cannot deadlock. Arguments are checked on call.
    """
    _check_positive(seq_len=seq_len, batch_size=batch_size, world_size=world_size, max_batches=max_batches)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if batch_size % world_size:
        raise ValueError(f"validation batch_size {batch_size} is not divisible by world_size {world_size}; "
                         f"set it to a multiple of {world_size}")
    tokens = _open_tokens(Path(token_path), dtype)
    total = _count_windows(len(tokens), seq_len)
    check_val_offset(offset, total, batch_size, f"the held-out split {token_path}", "windows")
    n_windows = total - offset
    if n_windows < world_size:
        raise ValueError(
            f"validation split is too small: {token_path} holds {n_windows} windows of seq_len+1={seq_len + 1} "
            f"tokens, fewer than world_size={world_size}; raise val_fraction or lower seq_len"
        )
    if n_windows >= batch_size:
        n_batches = min(max_batches, n_windows // batch_size)
    else:
        n_batches, batch_size = 1, (n_windows // world_size) * world_size
    return _iter_validation(tokens, seq_len, batch_size, rank, world_size, n_batches, vocab_size, Path(token_path),
                            offset)


def check_val_offset(offset: int, total: int, batch_size: int, split: str, unit: str) -> None:
    """Refuse a `training.val_offset` below 0 or one that leaves less than a batch of `total`
    held-out windows (images). Offset 0 is always taken: a split smaller than a batch then
    goes by the loader's own rule."""
    if offset < 0 or offset and total - offset < batch_size:
        most = total - batch_size
        room = (f"so at most {most} can be skipped before a batch of {batch_size}" if most >= 0
                else f"fewer than a batch of {batch_size}: val_offset must be 0")
        raise ValueError(f"training.val_offset = {offset}: {split} holds {total} {unit}, {room}")


def _iter_validation(tokens: np.ndarray, seq_len: int, batch_size: int, rank: int, world_size: int,
                     n_batches: int, vocab_size: int | None, path: Path,
                     offset: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    local = batch_size // world_size
    for j in range(n_batches):
        lo = offset + j * batch_size + rank * local
        yield _gather(tokens, np.arange(lo, lo + local), seq_len, vocab_size, path)
