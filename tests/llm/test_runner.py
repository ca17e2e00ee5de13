"""The model runner's decode path through its static buffers (what captured CUDA graphs read), on the CPU
target: the step functions the graphs would replay run eagerly over the same buffers, and a request's greedy
tokens equal those of the plain eager path while sequences join, grow new blocks, finish and leave rows."""

from kiln.llm import LLM, SamplingParams

PROMPTS = ["Hello world", "The potter lit the fire and", "Once upon a time", "0 1 2 3 4 5", "a b"]


def test_static_buffer_decode_equals_eager(tiny_llama):
    kw = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 4}
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 14, 5, 11, 7)]
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate(PROMPTS, params)]

    llm = LLM(tiny_llama, **kw)
    runner = llm.llm_engine.runner
    runner.make_static_buffers(4)
    runner.graphs = {b: runner.static_decode_step(b) for b in (1, 2, 4)}  # "replay" = run it from the buffers
    replays = []
    real = runner._replay
    runner._replay = lambda b, *a: replays.append(b) or real(b, *a)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    assert {1, 2, 4} <= set(replays)  # padded buckets (3 rows in 4) and a lone last sequence both ran
    s = llm.llm_engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
