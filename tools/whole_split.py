"""
--eval_iters=0: the whole split's loss, every token of val.bin after the first predicted once, as lm-eval's rolling
loglikelihood reads a text (train.py's estimate_loss imports it only then).

    for x, y in whole_split(batches, "val"):   # (B, T) each; targets already scored are -1
"""

import torch

from core.dataset import Batches, read_windows


def whole_split_batches(batches: Batches, split: str, rank: int = 0, world_size: int = 1) -> int:
    """How many batches whole_split yields on this rank."""
    tokens, T = batches.tokens(split), batches.block_size
    starts = range(0, tokens - 1, T)[rank::world_size]
    full = sum(s + T < tokens for s in starts)  # the rest: one short window each, at the end
    return -(-full // batches.batch_size) + len(starts) - full


def whole_split(batches: Batches, split: str, rank: int = 0, world_size: int = 1):
    """Every token of a split after the first predicted once, as lm-eval's rolling loss reads a text: consecutive
    windows of block_size targets, batch_size at a time, this rank's share: (x, y). The last targets, fewer than
    block_size, are read as lm-eval reads them: the last full window, its targets already scored set to -1."""
    path, T, tokens = batches.opened[split], batches.block_size, batches.tokens(split)
    starts = list(range(0, tokens - 1, T))[rank::world_size]
    full = [s for s in starts if s + T < tokens]
    for i in range(0, len(full), batches.batch_size):
        yield batches.windows(split, torch.tensor(full[i:i + batches.batch_size]))
    for s in starts[len(full):]:  # the end of the file: n < T targets left
        n = tokens - 1 - s
        window = read_windows(path, [max(0, tokens - 1 - T)], min(T, tokens - 1))  # (1, <= T + 1)
        x, y = window[:, :-1].clone(), window[:, 1:].clone()  # (1, T) each, apart: y is written next
        y[:, :y.size(1) - n] = -1  # scored in the window before: context now, not targets
        yield x, y
