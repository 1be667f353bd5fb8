"""generate.Decoder's bookkeeping, driven by a mock model whose next token is fixed (as nanochat tests its engine):
which positions each step sends, when the cache is made, and when the text outgrows block_size. No GPT, no
kernels: milliseconds."""

from types import SimpleNamespace

import torch

from engine.generate import Decoder

VOCAB = 17


class MockModel:
    """Next token = last token + 1 (mod VOCAB), as a one-hot logit row; every call and cache set-up is recorded."""

    def __init__(self, block_size: int):
        self.config = SimpleNamespace(block_size=block_size)
        self.cache = None
        self.transformer = SimpleNamespace(wpe=SimpleNamespace(weight=torch.zeros(1)))
        self.calls: list[tuple[list[int], list[int] | None]] = []  # (last tokens of each call, positions)
        self.caches: list[tuple[int, torch.dtype]] = []

    def __call__(self, idx: torch.Tensor, input_pos: torch.Tensor | int | None = None):
        positions = input_pos if input_pos is None or torch.is_tensor(input_pos) else torch.tensor([input_pos])
        self.calls.append((idx[0].tolist(), None if positions is None else positions.tolist()))
        logits = torch.nn.functional.one_hot((idx[:, -1:] + 1) % VOCAB, VOCAB).float()  # (B, 1, V)
        return logits, None

    def compute_dtype(self) -> torch.dtype:
        return torch.float32

    def setup_cache(self, batch_size: int, dtype: torch.dtype) -> None:
        self.caches.append((batch_size, dtype))
        self.cache = SimpleNamespace(batch_size=batch_size, dtype=dtype)  # buffers only: the loop owns the position


def greedy(model: MockModel, prompt: list[list[int]], new_tokens: int, use_cache: bool = True) -> list[list[int]]:
    out = Decoder(model).generate(torch.tensor(prompt), new_tokens, temperature=0.0, use_cache=use_cache)
    return out.tolist()


def test_a_prefill_from_position_0_then_one_token_per_step_at_its_own_position():
    model = MockModel(block_size=16)
    assert greedy(model, [[3, 4, 5]], 4) == [[3, 4, 5, 6, 7, 8, 9]]
    assert model.calls == [([3, 4, 5], [0, 1, 2]), ([6], [3]), ([7], [4]), ([8], [5])]
    assert vars(model.cache).keys() == {"batch_size", "dtype"}  # the loop kept its position to itself
    assert model.caches == [(1, torch.float32)]


def test_past_block_size_every_step_runs_the_last_block_again_from_position_0():
    model = MockModel(block_size=4)
    assert greedy(model, [[1, 2, 3]], 3) == [[1, 2, 3, 4, 5, 6]]
    # 3 tokens: prefill; the 4th fits (position 3); then the text is 5 long and every position shifts
    assert model.calls == [([1, 2, 3], [0, 1, 2]), ([4], [3]), ([2, 3, 4, 5], [0, 1, 2, 3])]


def test_without_the_cache_every_step_reads_the_cropped_context_and_no_cache_is_made():
    model = MockModel(block_size=4)
    assert greedy(model, [[1, 2, 3]], 3, use_cache=False) == [[1, 2, 3, 4, 5, 6]]
    assert model.calls == [([1, 2, 3], None), ([1, 2, 3, 4], None), ([2, 3, 4, 5], None)]
    assert model.caches == []


def test_a_one_token_prompt_starts_with_a_decode_step_and_rows_stay_apart():
    model = MockModel(block_size=8)
    assert greedy(model, [[0], [10]], 2) == [[0, 1, 2], [10, 11, 12]]
    assert [positions for _, positions in model.calls] == [[0], [1]]


def test_the_cache_is_made_once_per_batch_size_and_reused():
    model = MockModel(block_size=8)
    decoder = Decoder(model)
    for batch in (1, 1, 2, 2):
        decoder.generate(torch.zeros(batch, 2, dtype=torch.long), 2, temperature=0.0)
    assert model.caches == [(1, torch.float32), (2, torch.float32)]
