"""The model runner's decode path through its static buffers (what captured CUDA graphs read), on the CPU
target: the step functions the graphs would replay run eagerly over the same buffers, and a request's greedy
tokens equal those of the plain eager path while sequences join, grow new blocks, finish and leave rows; the
greedy tokens taken inside the decode step (graph_argmax, kernels/argmax.py under TRITON_INTERPRET here) equal
torch.argmax's, stepped one by one and with async decode."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # graph_argmax's Triton kernel on the CPU

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


def test_static_buffer_rows_after_preemption(tiny_llama):
    """Preempted sequences come back on new blocks, often in a row that held them before with a table of the same
    length: the host mirror's rows must follow the new blocks (a freed sequence's table is a new list)."""
    kw = {"max_model_len": 48, "block_size": 4, "max_num_seqs": 4, "num_kv_blocks": 12}
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, max_model_len=48, block_size=4).generate(PROMPTS[:4],
                                                                                                    params)]
    llm = LLM(tiny_llama, **kw)
    runner = llm.llm_engine.runner
    runner.make_static_buffers(4)
    runner.graphs = {b: runner.static_decode_step(b) for b in (1, 2, 4)}
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)] == want
    s = llm.llm_engine.stats()
    assert s["num_preemptions"] > 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


def test_graph_buckets():
    from kiln.llm.runner import graph_buckets

    assert graph_buckets(1) == [1] and graph_buckets(3) == [1, 2, 3] and graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert graph_buckets(300)[-3:] == [192, 256, 300]


def test_host_mirror_rows_follow_the_tables(tiny_llama):
    """The pinned host mirror of the block tables: a row gets a sequence's new blocks as its list grows, and all
    of another sequence's blocks when the row changes hands (rows written nowhere: slots -1)."""
    llm = LLM(tiny_llama, max_model_len=64, block_size=4, max_num_seqs=4)
    r = llm.llm_engine.runner
    r.make_static_buffers(4)
    r.graphs = {b: r.static_decode_step(b) for b in (1, 2, 4)}

    def rows(tables):
        n = len(tables)
        r._replay(4, [5] * n, [0] * n, [-1] * n, [1] * n, tables)
        return [r._h_tables[i, :len(t)].tolist() for i, t in enumerate(tables)]

    a, b = [1, 2], [3]
    assert rows([a, b]) == [[1, 2], [3]]
    a.append(7)
    assert rows([a, b]) == [[1, 2, 7], [3]]
    assert rows([b, a]) == [[3], [1, 2, 7]]
    c = [8, 9, 10]  # a's sequence freed and given new blocks: a new list of the same length
    assert rows([b, c]) == [[3], [8, 9, 10]]


def test_graph_argmax_gives_the_same_tokens(tiny_llama):
    kw = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 4}
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 14, 5, 11, 7)]
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate(PROMPTS, params)]
    for async_decode in (False, True):
        llm = LLM(tiny_llama, **kw)
        eng = llm.llm_engine
        runner = eng.runner
        runner.graph_argmax = True
        runner.make_static_buffers(4)
        runner.graphs = {b: runner.static_decode_step(b) for b in (1, 2, 4)}
        eng.async_decode = async_decode
        given = []

        def spy(samplers, logits, tokens=None, real=runner._argmax, given=given):
            given.append(tokens is not None)
            return real(samplers, logits, tokens)

        runner._argmax = spy
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert got == want
        assert any(given) and not all(given)  # decode steps took the graph's tokens, prefill steps torch's
        s = eng.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_argmax_in_cuda_graphs(tiny_llama):
    """On CUDA, graphs captured again with graph_argmax: the same greedy tokens as torch.argmax after the
    replay, with async decode too, and no KV block left taken."""
    kw = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 4, "device": "cuda", "dtype": "fp32"}
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 14, 5, 11, 7)]
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate(PROMPTS, params)]
    llm = LLM(tiny_llama, **kw)
    eng = llm.llm_engine
    assert eng.runner.graphs and not eng.runner.graph_argmax
    eng.runner.graph_argmax = True
    eng.runner.capture_graphs(4)
    assert sorted(eng.runner.graphs) == [1, 2, 4] and eng.runner.graph_error is None
    for async_decode in (False, True):
        eng.async_decode = async_decode
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    s = eng.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
