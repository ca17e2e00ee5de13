"""A sequence: one completion of a request, its tokens, KV blocks, and where it stands in the scheduler."""

from __future__ import annotations

import enum
import itertools
import time

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params, *,
                 parent: "Sequence | None" = None, eos_token_ids: frozenset = frozenset(),
                 detokenizer=None, arrival_time: float | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.parent = parent  # sibling whose prompt blocks this one waits to share (n > 1)
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then generated tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        # Only grows (kv_cache.BlockManager appends) until the blocks are freed, which gives it a new list.
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # prefix-cache bookkeeping (kv_cache.BlockManager)
        self.last_block_hash = None
        self.eos_token_ids = eos_token_ids
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # The token is the argmax of the raw logits (greedy, no penalty, logprobs or min_tokens): the sampler's
        # one-kernel case.
        self.argmax_only = (params.temperature == 0 and params.logprobs is None and params.repetition_penalty == 1.0
                            and not params.presence_penalty and not params.frequency_penalty
                            and not params.min_tokens)
        # Per-request randomness, the same whatever else is batched: the sampler makes the generator, seeded
        # with this, on the device it draws on.
        self.seed = params.seed + index if params.seed is not None else None
        self.generator = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def output_text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
