"""Serving measurements of an LLMEngine: throughput, TTFT, TPOT, end-to-end latency, and the HBM roofline.

All requests of a run are submitted at once; the engine's max_num_seqs bounds how many run together (the
batch size). Output tokens per second = all generated tokens / wall time. TTFT = first token - arrival; TPOT =
(last token - first token) / (output tokens - 1); e2e = last token - arrival; each reported as p50 and p99.

Host share of a decode step = 1 - (its CUDA graph's GPU time) / (the step's wall time); HostPhases splits a
run's wall time per step into the engine's parts.

Roofline (CUDA): a decode step must read every weight once and each sequence's cached K/V. At batch B with
average context C, bytes per step = weight bytes + B * C * KV bytes per token, so the bound is
B / (bytes per step / bandwidth) tokens per second, with the bandwidth measured here by a device-to-device
copy (what the HBM sustains for a stream of reads and writes).
"""

from __future__ import annotations

import hashlib
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


def run_requests(engine, prompts: list[list[int]], output_lens: list[int], time_limit_s: float | None = None,
                 output_kind: str = "final_only") -> dict:
    """Runs all prompts to their output length (greedy, ignore_eos) and measures them. time_limit_s: stop
    stepping once this much wall time has passed, abort what is left and measure what ran ("cut": True): the
    output tokens made in that time over that time, and the latencies of the requests that got that far.
    output_kind: what the engine builds each step (SamplingParams.output_kind; the measurements read the
    sequences themselves)."""
    from kiln.llm.sampling import SamplingParams

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    params = {n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, output_kind=output_kind)
              for n in set(output_lens)}
    seqs = []
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"bench-{i}", p, params[n], arrival_time=t0)
        seqs.append(engine.requests[f"bench-{i}"].seqs[0])
    tokens_before = engine.generation_tokens_total
    steps, decode_steps, decode_time, cut = 0, 0, 0.0, False
    by_batch: dict[int, list] = {}  # decode-only steps by batch size: [count, seconds]
    while engine.has_unfinished_requests():
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            cut = True
            break
        s0 = time.perf_counter()
        running_before = len(engine.scheduler.running)
        waiting_before = len(engine.scheduler.waiting)
        engine.step()
        dt = time.perf_counter() - s0
        steps += 1
        if waiting_before == 0 and running_before and all(s.num_computed_tokens >= s.prompt_len
                                                          for s in engine.scheduler.running):
            decode_steps += 1
            decode_time += dt
            n_t = by_batch.setdefault(running_before, [0, 0.0])
            n_t[0] += 1
            n_t[1] += dt
    sync()
    wall = time.perf_counter() - t0
    out_tokens = engine.generation_tokens_total - tokens_before
    for i in range(len(prompts)):
        engine.abort_request(f"bench-{i}")
    ttft = [s.first_token_time - s.arrival_time for s in seqs if s.first_token_time is not None]
    done = [s for s in seqs if s.finish_reason == "length"]
    e2e = [s.finish_time - s.arrival_time for s in done]
    tpot = [(s.finish_time - s.first_token_time) / (s.num_output_tokens - 1) for s in done
            if s.num_output_tokens > 1]
    ms = 1000.0
    return {
        "requests": len(prompts), "finished": len(done), "cut": cut, "output_tokens": out_tokens, "wall_s": wall,
        "steps": steps, "output_tok_s": out_tokens / wall,
        # prompt tokens of the requests that reached their first token
        "total_tok_s": (out_tokens + sum(len(p) for p, s in zip(prompts, seqs) if s.first_token_time)) / wall,
        "ttft_ms_p50": _ms(percentile(ttft, 0.5)), "ttft_ms_p99": _ms(percentile(ttft, 0.99)),
        "tpot_ms_p50": _ms(percentile(tpot, 0.5)), "tpot_ms_p99": _ms(percentile(tpot, 0.99)),
        "e2e_ms_p50": _ms(percentile(e2e, 0.5)), "e2e_ms_p99": _ms(percentile(e2e, 0.99)),
        "decode_step_ms": decode_time / decode_steps * ms if decode_steps else None,
        "decode_steps": decode_steps,
        "decode_step_ms_by_batch": {b: t / n * ms for b, (n, t) in sorted(by_batch.items())},
        "cuda_graphs": sorted(engine.runner.graphs), "cuda_graph_error": engine.runner.graph_error,
        # every request's output tokens in request order, hashed: two runs of the same prompts compare by it
        "tokens_digest": hashlib.sha1(repr([s.token_ids[s.prompt_len:] for s in seqs]).encode()).hexdigest(),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


class HostPhases:
    """Wall time per step in the scheduler, input preparation, the forward's launch (run_inputs: the
    host-to-device copies and the graph launch, or the eager forward), collect (the wait for the GPU's tokens,
    or the sampler) and the engine's own bookkeeping (the rest); and launch_path: from a step's tokens
    reaching the host to the next step queued on the device, the host time the GPU waits on."""

    def __init__(self, eng):
        self.eng, self.totals = eng, {}
        self.targets = [(eng.scheduler, "schedule"), (eng.runner, "prepare"), (eng.runner, "run_inputs"),
                        (eng.runner, "collect"), (eng, "_launch")]
        self.collected_at = None

    def __enter__(self):
        self.saved = []
        self.totals = {name: 0.0 for _, name in self.targets if name != "_launch"}
        self.totals["launch_path"] = 0.0
        for obj, name in self.targets:
            fn = getattr(obj, name)
            self.saved.append((obj, name, vars(obj).get(name)))  # an instance attribute or None

            def timed(*a, _fn=fn, _name=name, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    now = time.perf_counter()
                    if _name == "_launch":
                        if self.collected_at is not None:
                            self.totals["launch_path"] += now - self.collected_at
                            self.collected_at = None
                    else:
                        self.totals[_name] += now - t
                        if _name == "collect":
                            self.collected_at = now

            setattr(obj, name, timed)
        return self

    def __exit__(self, *exc):
        for obj, name, own in self.saved:
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)  # the class's method shows through again
        return False

    def per_step(self, steps: int, wall_s: float) -> dict:
        out = {k: round(v / max(steps, 1) * 1e6, 1) for k, v in self.totals.items()}
        out["engine_rest"] = round(wall_s / max(steps, 1) * 1e6 - sum(v for k, v in out.items()
                                                                      if k != "launch_path"), 1)
        return out


def graph_times_ms(eng) -> dict[int, float]:
    """Mean GPU time of the decode graphs a run replayed (runner.graph_times set to a list before it), per
    bucket; clears the list."""
    torch.cuda.synchronize()
    by: dict[int, list] = {}
    for b, start, end in eng.runner.graph_times:
        by.setdefault(b, []).append(start.elapsed_time(end))
    eng.runner.graph_times.clear()
    return {b: sum(v) / len(v) for b, v in sorted(by.items())}


def graph_replay_ms(eng, b: int, iters: int = 20) -> float:
    """GPU time of one decode step's graph at batch b (static buffers as the last step left them)."""
    with torch.inference_mode():
        return _time_ms(eng.runner.graphs[eng.runner._bucket(b)], eng.device, iters)


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


def decode_step_at_context(engine, batch_size: int, context: int, iters: int = 20) -> dict:
    """GPU time of one decode step (its captured CUDA graph) with batch_size sequences each holding `context`
    tokens of KV, every sequence on its own blocks. The static buffers are filled directly, as a step at that
    context would leave them: the time depends on the bytes read (weights, and K/V in the cache's dtype), not
    on their values, so no prompt is prefilled. Needs batch_size * ceil(context / block_size) KV blocks."""
    r = engine.runner
    bucket = r._bucket(batch_size)
    if bucket is None or bucket != batch_size:
        raise ValueError(f"no CUDA graph captured at batch {batch_size} (buckets {sorted(r.graphs)})")
    bs = r.block_size
    per_seq = -(-context // bs)
    if batch_size * per_seq > r.num_blocks or per_seq > r.max_blocks_per_seq:
        raise ValueError(f"{batch_size} sequences of {context} tokens need {batch_size * per_seq} KV blocks and "
                         f"{per_seq} per sequence; the pool has {r.num_blocks}, a table {r.max_blocks_per_seq}")
    dev = r.device
    tables = torch.arange(batch_size * per_seq, dtype=torch.int32, device=dev).view(batch_size, per_seq)
    r.g_tables[:batch_size, :per_seq] = tables
    r.g_lens[:batch_size] = context
    r.g_pos[:batch_size] = context - 1
    r.g_slots[:batch_size] = tables[:, (context - 1) // bs].long() * bs + (context - 1) % bs
    r.g_ids[:batch_size] = 1
    r._rows = [(None, 0)] * len(r._rows)  # the host mirror no longer says what the device rows hold
    r.h_i32.copy_(r.g_i32)
    r.h_i64.copy_(r.g_i64)
    with torch.inference_mode():
        step_ms = _time_ms(r.graphs[bucket], dev, iters)
    kv_bytes = batch_size * context * r.kv_bytes_per_token()
    return {"batch": batch_size, "context": context, "step_ms": step_ms, "tok_s": batch_size / step_ms * 1000,
            "kv_bytes_per_step": kv_bytes, "weight_bytes": engine.model.weight_bytes(),
            "kv_cache_dtype": str(r.kv_dtype).removeprefix("torch.")}


def _time_ms(fn, device, iters: int) -> float:
    """Milliseconds per call of fn: CUDA events on the GPU, the wall clock elsewhere (after one untimed call)."""
    fn()
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters * 1000
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def hf_generate_baseline(hf_model, prompts: list[list[int]], output_len: int, batch_size: int,
                         max_batches: int | None = None, static_compiled: bool = False) -> dict:
    """transformers' generate (greedy) over the prompts in batches of batch_size, equal-length prompts: eager
    with its dynamic cache, or (static_compiled) with its static cache and the forward under torch.compile
    (transformers compiles the decoding forward itself for a static cache on CUDA; the first call, which
    compiles, is timed apart as compile_s)."""
    dev = next(hf_model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)][:max_batches]
    kw = {}
    if static_compiled:
        from transformers.generation.configuration_utils import CompileConfig

        kw = {"cache_implementation": "static", "compile_config": CompileConfig()}

    def generate(ids):
        with torch.inference_mode():
            return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                     min_new_tokens=output_len, do_sample=False, pad_token_id=0, **kw)

    out = {"mode": "static cache, torch.compile" if static_compiled else "eager"}
    if static_compiled:  # compile (and capture) on the first batch's shape, untimed
        ids = torch.tensor(batches[0], device=dev)
        sync()
        t0 = time.perf_counter()
        generate(ids)
        sync()
        out["compile_s"] = time.perf_counter() - t0
    tokens, wall = 0, 0.0
    for batch in batches:
        ids = torch.tensor(batch, device=dev)
        sync()
        t0 = time.perf_counter()
        res = generate(ids)
        sync()
        wall += time.perf_counter() - t0
        tokens += (res.shape[1] - ids.shape[1]) * ids.shape[0]
    out.update({"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
                "step_ms": wall / (output_len * len(batches)) * 1000, "batch": batch_size,
                "output_len": output_len})
    return out
