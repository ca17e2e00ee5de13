"""SamplingParams and the sampler: one batched pass over the logits of every sequence that samples this step.

Order, as vLLM applies them: penalties (repetition over prompt + output; presence and frequency over the
output), temperature, top-k, top-p, min-p, then a draw (greedy rows take the argmax). Rows with a seed draw
from their own torch.Generator (on the logits' device), so a seeded request's tokens do not depend on its batch.
Logprobs are those of the model's distribution (log-softmax of the raw logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kiln.errors import InputError


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # "cumulative": a RequestOutput (all text and tokens so far) each step the request produces a token;
    # "delta": the same steps, each output holding only what that step added (what a server streams);
    # "final_only": one, when it finishes (what offline generate needs: no per-step output is built).
    output_kind: str = "cumulative"
    # False: no text is made (outputs carry token ids and "" for text), for a caller that detokenizes itself, as
    # a server's HTTP process does; stop strings are matched on the text, so they need True.
    detokenize: bool = True
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        def bad(name, why):
            raise InputError(f"SamplingParams.{name} = {getattr(self, name)!r}: {why}.")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            bad("max_tokens", "must be an integer > 0")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not is_num(getattr(self, name)):
                bad(name, "must be a number")
        if self.temperature < 0:
            bad("temperature", "must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= 0 (0 or -1 = off)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0 (1 = off)")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer")
        if self.stop is not None and (not isinstance(self.stop, list) or
                                      not all(isinstance(s, str) and s for s in self.stop)):
            bad("stop", "must be a list of non-empty strings")
        if self.stop_token_ids is not None and not all(is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"must be one of {list(OUTPUT_KINDS)}")
        if not self.detokenize and self.stop:
            bad("detokenize", "stop strings are matched on the text, so they need detokenize = True")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Build from a dict (a request body); unknown keys are refused by name."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}.")
        return cls(**d)


def _token_counts(lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[len(lists), vocab] FP32: how often each row's list holds each token id (ids outside the vocabulary
    dropped), made by one scatter."""
    rows = torch.tensor([j for j, ids in enumerate(lists) for _ in ids], dtype=torch.long)
    ids = torch.tensor([t for ids in lists for t in ids], dtype=torch.long)
    keep = ids < vocab
    counts = torch.zeros(len(lists), vocab, device=device)
    rows, ids = rows[keep].to(device), ids[keep].to(device)
    counts.index_put_((rows, ids), torch.ones(ids.shape[0], device=device), accumulate=True)
    return counts


def _penalize(logits: torch.Tensor, rows: list[int], seqs, params) -> None:
    """Repetition (over prompt + output), presence and frequency penalties (over the output) of `rows`, in place,
    every row at once."""
    dev, vocab = logits.device, logits.shape[1]
    idx = torch.tensor(rows, device=dev)
    sub = logits[idx]
    rep = [float(params[r].repetition_penalty) for r in rows]
    if any(v != 1.0 for v in rep):
        seen = _token_counts([seqs[r].token_ids for r in rows], vocab, dev) > 0
        rp = torch.tensor(rep, device=dev)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
    freq = [float(params[r].frequency_penalty) for r in rows]
    pres = [float(params[r].presence_penalty) for r in rows]
    if any(freq) or any(pres):
        counts = _token_counts([seqs[r].output_token_ids for r in rows], vocab, dev)
        sub = sub - torch.tensor(freq, device=dev)[:, None] * counts \
            - torch.tensor(pres, device=dev)[:, None] * (counts > 0).to(sub.dtype)
    logits[idx] = sub


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) what top-k [S] (0 = off), top-p [S] and min-p [S] exclude, row by row."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop |= before >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False  # the most likely token always stays
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


class Sampler:
    @staticmethod
    def plain_greedy(seqs) -> bool:
        """True when every sequence's token is the argmax of its raw logits (Sequence.argmax_only): the common
        serving case, one kernel on the device."""
        return all(s.argmax_only for s in seqs)

    def __call__(self, logits: torch.Tensor, seqs) -> tuple[list[int], list[dict | None]]:
        """logits [S, vocab] FP32 of the sequences that sample; returns their next tokens and top logprobs.
        Everything runs on the logits' device with the rows' parameters as [S] tensors; the host waits for the
        token ids (and the logprobs asked for) alone."""
        if self.plain_greedy(seqs):
            return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
        params = [s.params for s in seqs]
        dev = logits.device
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = None
        if any(n is not None for n in want_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        penal = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0 or p.presence_penalty
                 or p.frequency_penalty]
        if penal:
            logits = logits.clone()
            _penalize(logits, penal, seqs, params)
        for r, s in enumerate(seqs):  # min_tokens: end tokens are not allowed yet
            if s.params.min_tokens and s.num_output_tokens < s.params.min_tokens:
                stops = [t for t in s.eos_token_ids | set(s.params.stop_token_ids or []) if t < logits.shape[1]]
                if stops:
                    logits = logits.clone() if not penal else logits
                    logits[r, stops] = float("-inf")
        tokens = logits.argmax(dim=-1)  # greedy rows keep theirs
        rows = [r for r, p in enumerate(params) if not p.greedy]
        if rows:
            every = len(rows) == len(seqs)
            idx = None if every else torch.tensor(rows, device=dev)
            sub = logits if every else logits[idx]
            sub = sub / torch.tensor([float(params[r].temperature) for r in rows], device=dev)[:, None]
            top_k = [max(params[r].top_k, 0) for r in rows]
            top_p = [float(params[r].top_p) for r in rows]
            min_p = [float(params[r].min_p) for r in rows]
            if any(top_k) or min(top_p) < 1 or max(min_p) > 0:
                sub = apply_top_k_top_p_min_p(sub, torch.tensor(top_k, device=dev), torch.tensor(top_p, device=dev),
                                              torch.tensor(min_p, device=dev))
            probs = sub.softmax(dim=-1)
            # Exponential race (Gumbel-max in another form): argmax p / E with E ~ Exp(1). Unseeded rows draw
            # together from the global generator; a seeded row draws from its own, on this device.
            noise = torch.empty_like(probs)
            seeded = [j for j, r in enumerate(rows) if seqs[r].seed is not None]
            if len(seeded) < len(rows):
                noise.exponential_()
            for j in seeded:
                noise[j].exponential_(generator=_generator(seqs[rows[j]], dev))
            drawn = (probs / noise).argmax(dim=-1)
            tokens = drawn if every else tokens.index_copy(0, idx, drawn)
        out_tokens = tokens.tolist()
        top: list[dict | None] = [None] * len(seqs)
        ask = [r for r, n in enumerate(want_logprobs) if n is not None]
        if ask:
            lp = raw_logprobs if len(ask) == len(seqs) else raw_logprobs[torch.tensor(ask, device=dev)]
            chosen = lp.gather(1, torch.tensor([out_tokens[r] for r in ask], device=dev)[:, None])[:, 0].tolist()
            k = max(want_logprobs[r] for r in ask)
            vals, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            vals, ids = vals.tolist(), ids.tolist()
            for j, r in enumerate(ask):
                entry = {out_tokens[r]: chosen[j]}
                n = want_logprobs[r]
                entry.update({i: v for i, v in zip(ids[j][:n], vals[j][:n]) if i not in entry})
                top[r] = entry
        return out_tokens, top


def _generator(seq, device: torch.device) -> torch.Generator:
    """A seeded sequence's own generator on `device`, made at its first draw there."""
    g = seq.generator
    if g is None or g.device != device:
        g = seq.generator = torch.Generator(device=device)
        g.manual_seed(seq.seed)
    return g
