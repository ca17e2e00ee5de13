"""What the served engine does each step, on the tiny model on the CPU: its streamed outputs (output_kind
"delta") add up to the offline outputs, and the engine process's step frames decode to the same deltas; the step
profile records every step's batch and phases; the engine's CPU placement."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kiln.errors import ConfigError
from kiln.llm.engine import LLMEngine, SamplingParams
from kiln.serve import cpu_placement, step_profile
from kiln.serve.async_engine import DeltaMaker
from kiln.serve.step_frames import StepDecoder, StepEncoder, is_plain

KW = {"device": "cpu", "max_num_seqs": 4, "num_kv_blocks": 64, "max_model_len": 128, "max_num_batched_tokens": 24}


@pytest.fixture(scope="module")
def engine(tiny_llm):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLMEngine.from_model(str(tiny_llm), **KW)
    torch.set_num_threads(threads)


def _run(engine, requests, kind):
    """{request id: [RequestOutput of each step]} of requests (id, prompt, SamplingParams) run together."""
    got = {}
    for rid, prompt, p in requests:
        engine.add_request(rid, prompt, dataclasses.replace(p, output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    return got


def test_delta_outputs_add_up_to_the_final_ones(engine):
    # Five requests over four sequence slots and a 24-token budget: chunked prompts, a queue, n=2, a stop string,
    # logprobs, sampling with a seed.
    requests = [("a", "Hello world, this is a longer prompt " * 2, SamplingParams(temperature=0, max_tokens=9)),
                ("b", "The kiln", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=7, logprobs=2)),
                ("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, stop=["e"])),
                ("d", "Once", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]
    final = {rid: outs[-1] for rid, outs in _run(engine, requests, "final_only").items()}
    deltas = _run(engine, requests, "delta")
    assert set(deltas) == set(final)
    make = DeltaMaker()
    for rid, outs in deltas.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        streamed = [make(o) for o in outs]
        assert streamed[0][1] == final[rid].prompt_token_ids and all(d[1] is None for d in streamed[1:])
        for c in final[rid].outputs:
            pieces = [p for d in streamed for p in d[3] if p[0] == c.index]
            assert [t for p in pieces for t in p[2]] == c.token_ids
            assert "".join(p[1] for p in pieces) == c.text
            assert pieces[-1][3] == c.finish_reason and pieces[-1][4] == c.stop_reason
            assert all(p[3] is None for p in pieces[:-1])
            if c.logprobs is not None:
                assert [lp for p in pieces for lp in p[5]] == c.logprobs
    assert final["c"].outputs[0].finish_reason in ("stop", "length")
    assert engine.stats()["kv_blocks_free"] == KW["num_kv_blocks"]


@pytest.mark.parametrize("clients", [1, 2])
def test_step_frames_decode_to_the_deltas_of_delta_outputs(engine, clients):
    # The engine process's frames (plain streams read off their sequences as flat token lists, the rest as
    # deltas) decode, step by step, to what a DeltaMaker makes of "delta" outputs of the same requests; with two
    # HTTP processes (clients), each one's part of a step holds its own requests only.
    import marshal

    requests = [("a", "Hello world, this is a longer prompt " * 2, SamplingParams(temperature=0, max_tokens=9)),
                ("b", "The kiln", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=7, logprobs=2)),
                ("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, stop=["e"])),
                ("d", "Once", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
                ("e", [9, 8], SamplingParams(temperature=0, max_tokens=1))]
    requests = [(rid, prompt, dataclasses.replace(p, detokenize=bool(p.stop))) for rid, prompt, p in requests]

    def steps(add, encode):
        for rid, prompt, p in requests:
            add(rid, prompt, p)
        out = []
        while engine.has_unfinished_requests():
            out.append({d[0]: d for d in encode(engine.step())})
        return out

    make = DeltaMaker()
    want = steps(lambda rid, prompt, p: engine.add_request(rid, prompt, dataclasses.replace(p, output_kind="delta")),
                 lambda outs: [make(o) for o in outs])
    enc, decs = StepEncoder(engine, clients), [StepDecoder() for _ in range(clients)]
    owner = {rid: i % clients for i, (rid, _, _) in enumerate(requests)}

    def add(rid, prompt, p):
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "extra"}
        engine.add_request(rid, prompt, dataclasses.replace(p, output_kind=enc.output_kind(fields)))
        enc.add(rid, fields, owner[rid])
        decs[owner[rid]].expect(rid, engine.requests[rid].prompt_token_ids)

    def decode(outs):
        parts = enc.encode(outs)
        assert len(parts) == clients
        deltas = []
        for client, (dec, part) in enumerate(zip(decs, parts)):
            mine = dec.decode(*marshal.loads(marshal.dumps(part)))
            assert all(owner[d[0]] == client for d in mine)
            deltas += mine
        return deltas

    got = steps(add, decode)
    assert got == want
    assert sorted(rid for rid, _, p in requests if is_plain({f.name: getattr(p, f.name)
                                                             for f in dataclasses.fields(p)})) == ["a", "d", "e"]
    assert not any(rid in enc for rid, _, _ in requests)  # every finished stream left the encoder
    assert engine.stats()["kv_blocks_free"] == KW["num_kv_blocks"]


def test_step_profile_records_each_step_batch_and_phases(engine, tmp_path):
    profile = step_profile.StepProfile(engine)
    try:
        outs = _run(engine, [(f"p{i}", "Hello world " * (i + 1), SamplingParams(temperature=0, max_tokens=6))
                             for i in range(6)], "final_only")
    finally:
        del engine.step, engine.scheduler.schedule, engine.runner.prepare, engine.runner.run_inputs
        del engine.runner.collect
    assert len(outs) == 6
    recs = profile.records
    # Every generated token came out of a recorded step: 6 requests x 6 tokens over steps of at most 4 sequences.
    assert sum(r[step_profile.N_SEQS] for r in recs if r[step_profile.DECODE]) <= 6 * 6
    assert all(1 <= r[step_profile.N_SEQS] <= KW["max_num_seqs"] for r in recs)
    assert all(r[step_profile.N_TOKENS] <= KW["max_num_batched_tokens"] for r in recs)
    assert any(r[step_profile.DECODE] for r in recs) and any(not r[step_profile.DECODE] for r in recs)
    assert all(sum(r[2:6]) <= r[step_profile.TOTAL] + 1e-6 for r in recs)
    starts = [r[step_profile.START] for r in recs]
    assert starts == sorted(starts) and profile.between(starts[1], starts[-2]) == recs[1:-1]
    path = tmp_path / "steps.json"
    profile.save(path)
    assert step_profile.load(path) == recs
    table = step_profile.comparison_table(recs, recs, min_steps=1)
    assert "decode-only" in table and "with prompt" in table and "| 1.00 |" in table
    assert step_profile.summary(recs).startswith(f"{len(recs)} steps")


def test_engine_cpu_placement():
    assert cpu_placement.placement("none") is None and cpu_placement.placement(None) is None
    allowed = os.sched_getaffinity(0)
    auto = cpu_placement.placement("auto")
    if len(allowed) < 4:
        assert auto is None
    else:
        engine_cpus, rest = auto
        assert len(engine_cpus) == 1 and rest and not engine_cpus & rest and engine_cpus | rest <= allowed
    cpu = max(allowed)
    engine_cpus, rest = cpu_placement.placement(str(cpu))
    assert engine_cpus == {cpu} and rest
    with pytest.raises(ConfigError, match="CPUs"):
        cpu_placement.placement(str(max(allowed) + 1000))
    with pytest.raises(ConfigError, match="auto, none"):
        cpu_placement.placement("fast")
