"""The engine's overlapped step (step N+1 queued before step N's text and outputs are made) against steps run one
after the other: the same tokens, text, stops and logprobs for a mix of requests; a request aborted while its
step is in flight is dropped from it and leaks nothing; output kinds (final_only, cumulative)."""

from kiln.llm import LLM, SamplingParams

PROMPTS = ["Hello world", "The potter lit the fire and", "Once upon a time there was a small kiln", "0 1 2 3"]


def mixed_params(stop: str):
    return [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)]


def no_leak(llm):
    s = llm.llm_engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == s["num_waiting"] == 0


def test_overlapped_steps_equal_sequential_steps(tiny_llama):
    kw = {"max_model_len": 128, "block_size": 4, "max_num_batched_tokens": 16}
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seq_llm, llm = LLM(tiny_llama, **kw), LLM(tiny_llama, **kw)
    seq_llm.llm_engine.overlap_steps = False
    assert llm.llm_engine.overlap_steps
    # Both engines run this first (their prefix caches then hold the same blocks, so the batches match).
    stop = seq_llm.generate(PROMPTS[2], greedy)[0].outputs[0].text[4:7]  # a stop string the greedy text holds
    llm.generate(PROMPTS[2], greedy)
    want = seq_llm.generate(PROMPTS, mixed_params(stop))
    got = llm.generate(PROMPTS, mixed_params(stop))
    for a, b in zip(got, want):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
               (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason)
        assert ca.logprobs == cb.logprobs
    assert got[2].outputs[0].finish_reason == "stop" and got[2].outputs[0].stop_reason == stop
    no_leak(llm)


def test_abort_while_its_step_is_in_flight(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=128)
    want = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    eng = llm.llm_engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng._inflight is not None  # the next step, holding both, is queued
    eng.abort_request("a")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert {o.request_id for o in outs} == {"b"}
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    no_leak(llm)


def test_output_kinds(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=128)
    eng = llm.llm_engine
    eng.add_request("final", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                        output_kind="final_only"))
    eng.add_request("each", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    seen = {"final": [], "each": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append(len(o.outputs[0].token_ids))
    assert seen == {"final": [5], "each": [1, 2, 3, 4, 5]}
    no_leak(llm)


def _static_graphs(llm, n=4):
    r = llm.llm_engine.runner
    r.make_static_buffers(n)
    r.graphs = {b: r.static_decode_step(b) for b in (1, 2, 4)}  # "replay" = run it from the static buffers


def test_async_decode_equals_sequential_steps(tiny_llama):
    """Decode steps fed the previous step's argmax on the device (queued before its tokens reach the host): the
    same tokens, text and stops as steps run one after the other, with sequences ending by length, by a stop
    token, by a stop string and by EOS while the next step is already queued, and a request joining midway."""
    kw = {"max_model_len": 128, "block_size": 4, "max_num_seqs": 4}
    ref, llm = LLM(tiny_llama, **kw), LLM(tiny_llama, **kw)
    for x in (ref, llm):
        _static_graphs(x)
    ref.llm_engine.overlap_steps = False
    llm.llm_engine.async_decode = True
    fed = []
    real = llm.llm_engine.runner.launch_fed
    llm.llm_engine.runner.launch_fed = lambda *a: fed.append(len(a[0].seqs)) or real(*a)
    greedy = [o.outputs[0] for o in ref.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                                          ignore_eos=True))]
    llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))  # the same cache state
    fed.clear()
    eos = greedy[3].token_ids[5]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[greedy[1].token_ids[6]], ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, stop=[greedy[2].text[6:9]], ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0)]
    for x in (ref, llm):
        x.tokenizer.eos_token_ids = {eos}
    want = ref.generate(PROMPTS, params)
    got = llm.generate(PROMPTS, params)
    for a, b in zip(got, want):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
               (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason)
    assert [o.outputs[0].finish_reason for o in got] == ["length", "stop", "stop", "stop"]
    assert fed and 4 in fed  # decode steps of the whole batch went fed
    no_leak(llm)
    # A request joining while the others decode, and an abort with two steps queued.
    eng = llm.llm_engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.add_request("c", PROMPTS[2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request("a")
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    alone = {p: ref.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
             for p, n in ((PROMPTS[1], 10), (PROMPTS[2], 6))}
    assert sorted(outs) == ["b", "c"]
    assert outs["b"].outputs[0].token_ids == alone[PROMPTS[1]] and outs["c"].outputs[0].token_ids == alone[PROMPTS[2]]
    no_leak(llm)
