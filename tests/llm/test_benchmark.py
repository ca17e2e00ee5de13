"""kiln.llm.benchmark on the CPU target: a run cut at its time limit measures what ran and frees every block; the
decode step at a long context (static buffers filled directly) leaves the engine's next steps correct."""

from kiln.llm import LLM, SamplingParams
from kiln.llm import benchmark as bm


def test_run_cut_at_its_time_limit(tiny_llama):
    eng = LLM(tiny_llama, max_model_len=128).llm_engine
    prompts = bm.random_prompts(eng.model_config.vocab_size, [8] * 3)
    full = bm.run_requests(eng, prompts, [6] * 3)
    assert not full["cut"] and full["finished"] == 3 and full["output_tokens"] == 18 and full["tpot_ms_p50"] > 0
    cut = bm.run_requests(eng, prompts, [100] * 3, time_limit_s=0.0)  # stops after its first check
    assert cut["cut"] and cut["finished"] == 0 and cut["output_tokens"] == 0 and cut["e2e_ms_p50"] is None
    s = eng.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and not eng.has_unfinished_requests()


def test_decode_step_at_context_then_real_steps(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=128, max_num_seqs=2, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["Hello world", "The potter lit the fire and"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    eng = llm.llm_engine
    eng.runner.make_static_buffers(2)
    eng.runner.graphs = {b: eng.runner.static_decode_step(b) for b in (1, 2)}
    r = bm.decode_step_at_context(eng, 2, 100, iters=2)
    assert r["step_ms"] > 0 and r["kv_bytes_per_step"] == 2 * 100 * eng.runner.kv_bytes_per_token()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
