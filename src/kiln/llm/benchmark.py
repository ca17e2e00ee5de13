"""Serving measurements of an LLMEngine: throughput, TTFT, TPOT, end-to-end latency, and the HBM roofline.

All requests of a run are submitted at once; the engine's max_num_seqs bounds how many run together (the
batch size). Output tokens per second = all generated tokens / wall time. TTFT = first token - arrival; TPOT =
(last token - first token) / (output tokens - 1); e2e = last token - arrival; each reported as p50 and p99.

Roofline (CUDA): a decode step must read every weight once and each sequence's cached K/V. At batch B with
average context C, bytes per step = weight bytes + B * C * KV bytes per token, so the bound is
B / (bytes per step / bandwidth) tokens per second, with the bandwidth measured here by a device-to-device
copy (what the HBM sustains for a stream of reads and writes).
"""

from __future__ import annotations

import random
import time

import torch


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(vocab_size - 1, 16)  # skip the first ids: special tokens sit there in most vocabularies
    return [[rng.randrange(low, vocab_size) for _ in range(n)] for n in lengths]


def sharegpt_like_lengths(num: int, max_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(input, output) lengths drawn from log-normal laws shaped like ShareGPT's conversations (median input
    about 190 tokens, output about 180, long tails). Synthetic: no dataset is read."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(num):
        i = int(min(max(4, rng.lognormvariate(5.25, 0.9)), max_len // 2))
        o = int(min(max(4, rng.lognormvariate(5.2, 0.8)), max_len - i - 1))
        pairs.append((i, o))
    return pairs


def run_requests(engine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Runs all prompts to their output length (ignore_eos) and measures them."""
    from kiln.llm.sampling import SamplingParams

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    params = {n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, output_kind="final_only")
              for n in set(output_lens)}
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"bench-{i}", p, params[n], arrival_time=t0)
    finished, steps, decode_steps, decode_time = [], 0, 0, 0.0
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        running_before = len(engine.scheduler.running)
        waiting_before = len(engine.scheduler.waiting)
        outs = engine.step()
        dt = time.perf_counter() - s0
        steps += 1
        if waiting_before == 0 and running_before and all(s.num_computed_tokens >= s.prompt_len
                                                          for s in engine.scheduler.running):
            decode_steps += 1
            decode_time += dt
        finished += [o for o in outs if o.finished]
    sync()
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in finished]
    e2e = [o.metrics.finish_time - o.metrics.arrival_time for o in finished]
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in finished if len(o.outputs[0].token_ids) > 1]
    ms = 1000.0
    return {
        "requests": len(finished), "output_tokens": out_tokens, "wall_s": wall, "steps": steps,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + sum(len(p) for p in prompts)) / wall,
        "ttft_ms_p50": percentile(ttft, 0.5) * ms, "ttft_ms_p99": percentile(ttft, 0.99) * ms,
        "tpot_ms_p50": percentile(tpot, 0.5) * ms if tpot else None,
        "tpot_ms_p99": percentile(tpot, 0.99) * ms if tpot else None,
        "e2e_ms_p50": percentile(e2e, 0.5) * ms, "e2e_ms_p99": percentile(e2e, 0.99) * ms,
        "decode_step_ms": decode_time / decode_steps * ms if decode_steps else None,
        "cuda_graphs": sorted(engine.runner.graphs), "cuda_graph_error": engine.runner.graph_error,
    }


def copy_bandwidth(device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second a device-to-device copy moves (read + write counted)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1000.0)


def roofline(engine, batch_size: int, avg_context: float, bandwidth: float) -> dict:
    weight_bytes = engine.model.weight_bytes()
    kv_bytes = batch_size * avg_context * engine.runner.kv_bytes_per_token()
    step_s = (weight_bytes + kv_bytes) / bandwidth
    return {"weight_bytes": weight_bytes, "kv_bytes_per_step": int(kv_bytes), "bandwidth_GBs": bandwidth / 1e9,
            "roofline_step_ms": step_s * 1000, "roofline_tok_s": batch_size / step_s}


def hf_generate_baseline(hf_model, prompts: list[list[int]], output_len: int, batch_size: int,
                         max_batches: int | None = None) -> dict:
    """transformers' generate (eager, greedy) over the prompts in batches of batch_size, equal-length prompts."""
    dev = next(hf_model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)][:max_batches]
    tokens, wall = 0, 0.0
    for batch in batches:
        ids = torch.tensor(batch, device=dev)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                    min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        sync()
        wall += time.perf_counter() - t0
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "step_ms": wall / (output_len * len(batches)) * 1000}

