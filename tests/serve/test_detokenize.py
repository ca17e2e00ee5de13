"""The server process's text of streams the engine does not detokenize (kiln/serve/detokenize.py): the same text,
piece by piece, as the engine's own IncrementalDetokenizer, from random token streams (split multi-byte
characters, special tokens, a special stop token) and from the tiny model's steps."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kiln.errors import InputError
from kiln.llm.engine import LLMEngine, SamplingParams
from kiln.llm.tokenizer import IncrementalDetokenizer, Tokenizer
from kiln.serve.async_engine import DeltaMaker
from kiln.serve.detokenize import StreamDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llm):
    return Tokenizer.from_file(tiny_llm / "tokenizer.json", tiny_llm / "tokenizer_config.json")


def test_batched_stream_text_equals_the_engines_incremental_text(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    eos = min(tokenizer.eos_token_ids)
    specials = sorted(tokenizer._special_ids)
    streams = {}  # rid -> (prompt, tokens, skip, ends on a special stop token)
    for i in range(40):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
        tokens = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(vocab)
                  for _ in range(rng.randrange(1, 30))]
        special_stop = i % 3 == 0
        if special_stop:
            tokens.append(eos)
        streams[f"r{i}"] = (prompt, tokens, i % 4 != 1, special_stop)
    # The engine's text: IncrementalDetokenizer as LLMEngine._append_token drives it.
    want = {}
    for rid, (prompt, tokens, skip, special_stop) in streams.items():
        d = IncrementalDetokenizer(tokenizer, prompt, skip)
        for t in tokens[:-1]:
            d.add(t)
        if not (special_stop and skip):  # a special stop token is not shown when special tokens are skipped
            d.add(tokens[-1])
        d.flush()
        want[rid] = d.text
    # The server's: one step's Deltas at a time, every stream of the step in one fill.
    text = StreamDetokenizer(tokenizer)
    for rid, (prompt, _, skip, _) in streams.items():
        text.open(rid, prompt, skip)
    got = {rid: "" for rid in streams}
    for step in range(max(len(s[1]) for s in streams.values())):
        deltas, plain = [], ([], [])  # half the streams' single unfinished tokens as step_frames.py's flat lists
        for i, (rid, (prompt, tokens, _, special_stop)) in enumerate(streams.items()):
            if step < len(tokens):
                last = step == len(tokens) - 1
                if not last and i % 2:
                    plain[0].append(rid)
                    plain[1].append(tokens[step])
                    continue
                finish = ("stop" if special_stop else "length") if last else None
                stop = tokens[-1] if last and special_stop else None
                deltas.append((rid, prompt if step == 0 else None, last, [(0, "", [tokens[step]], finish, stop, None)]))
        for d in text.fill(deltas):
            got[d[0]] += d[3][0][1]
        for rid, piece in zip(plain[0], text.texts(*plain)):
            got[rid] += piece
    assert got == want
    assert not any(rid in text for rid in streams)  # finished streams leave nothing behind


def test_engine_without_text_plus_server_text_equals_the_engines_text(tiny_llm, tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine.from_model(str(tiny_llm), device="cpu", max_num_seqs=4, num_kv_blocks=64,
                                      max_model_len=128, max_num_batched_tokens=24)
        requests = [("a", "Hello world, this is a longer prompt " * 2, SamplingParams(temperature=0, max_tokens=9)),
                    ("b", "The kiln", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=7)),
                    ("d", "Once", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]
        finals = {}
        for rid, prompt, p in requests:
            engine.add_request(rid, prompt, dataclasses.replace(p, output_kind="final_only"))
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step())
        text, make, got = StreamDetokenizer(tokenizer), DeltaMaker(), {}
        for rid, prompt, p in requests:
            engine.add_request(rid, prompt, dataclasses.replace(p, output_kind="delta", detokenize=False))
            text.open(rid, engine.requests[rid].prompt_token_ids, p.skip_special_tokens)
        while engine.has_unfinished_requests():
            deltas = [make(o) for o in engine.step()]
            assert all(c[1] == "" for d in deltas for c in d[3])  # the engine made no text
            for d in text.fill(deltas):
                for c in d[3]:
                    got[(d[0], c[0])] = got.get((d[0], c[0]), "") + c[1]
        assert got == {(rid, c.index): c.text for rid, o in finals.items() for c in o.outputs}
        assert all(t for t in got.values())
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(InputError, match="detokenize"):
        SamplingParams(stop=["e"], detokenize=False)
