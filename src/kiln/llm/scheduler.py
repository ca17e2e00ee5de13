"""In-flight batching: which sequences run in the next step, and how many of their tokens.

A step holds a token budget (max_num_batched_tokens) and a sequence budget (max_num_seqs). Running sequences
go first, in arrival order: a decoding sequence takes one token, a sequence still in its prompt takes as much of
the rest as the budget allows (chunked prefill, mixed with the decodes). Then waiting sequences are admitted
FIFO. When the KV pool runs out, the newest running sequence is preempted: its blocks are freed and it returns
to the head of the queue, to be recomputed (its generated tokens are kept and recomputed with the prompt).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kiln.llm.kv_cache import BlockManager
from kiln.llm.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed this step
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return sum(self.num_new_tokens) == len(self.num_new_tokens)  # every count is at least 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        seqs, counts, preempted = [], [], 0
        running, bm, bs = self.running, self.bm, self.bm.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            c = seq.num_computed_tokens
            n = min(len(seq.token_ids) - c, budget)
            # One token at a slot inside a block already held (c % bs) needs no block: the common decode step.
            if (n != 1 or c % bs == 0) and not bm.try_append(seq, n):
                while True:
                    victim = running.pop()  # newest first
                    self._preempt(victim)
                    preempted += 1
                    if victim is seq or bm.try_append(seq, n):
                        break
                if victim is seq:
                    break  # seq itself was preempted: everything after it was too
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            parent = seq.parent
            if (parent is not None and self.bm.enable_prefix_caching and not parent.is_finished
                    and parent.num_computed_tokens < parent.prompt_len):
                break  # wait one step: then its prompt blocks are cached and shared instead of recomputed
            fresh = seq.num_preemptions == 0
            cached = self.bm.allocate_cached_prefix(seq)
            seq.num_computed_tokens = cached
            n = min(seq.num_tokens - cached, budget)
            if not self.bm.can_append(seq, n):
                self.bm.free_sequence(seq)
                break
            if fresh:
                self.bm.record_prefix_lookup(seq.prompt_len, cached)
            self.bm.append_slots(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledStep(seqs, counts, preempted)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Mark seq finished and return its blocks (finished, stopped or aborted alike)."""
        was = seq.status
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if was == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif was == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq)
