"""`kiln llm ...`: generate text and benchmark decoder models.

    kiln llm generate MODEL --prompt "Hello" --maxTokens 32 --temperature 0
    kiln llm bench MODEL --inputLen 128 --outputLen 256 --batchSize 64 --numPrompts 64 --baseline hf --json

MODEL is a Hugging Face directory (config.json + *.safetensors + tokenizer.json), a .gguf file or a .kiln LLM
engine. Other `kiln llm` subcommands (build, perplexity) come from the modules in _SUBCOMMANDS, each with
`add_llm_command(llm_sub)`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kiln.errors import ConfigError, InputError

# Modules adding `kiln llm <name>` subcommands; each defines add_llm_command(llm_subparsers). A module that is
# not importable (not written yet, or its optional dependency missing) is skipped.
_SUBCOMMANDS = ["kiln.llm.engine_file", "kiln.llm.perplexity", "kiln.serve.llm_cli"]


def _engine_kwargs(a) -> dict:
    """LLMEngine keywords from the flags; with --verifyKey, MODEL is first checked to be an engine signed with it."""
    from kiln.engine.signing import load_key
    from kiln.llm.engine_file import require_signed

    require_signed(a.model, load_key(a.verify_key) if getattr(a, "verify_key", None) else None)
    kw = dict(device=a.device, kv_cache_dtype=a.kv_cache_dtype, dtype=a.dtype, block_size=a.block_size,
              enable_prefix_caching=not a.no_prefix_caching, enforce_eager=a.enforce_eager,
              quantization=a.weights, kv_calib=a.calib,
              progress=not getattr(a, "json", False))  # the loading bar: stderr, on a terminal, not with --json
    if getattr(a, "tp", None) is not None:  # else a built engine's own tensor-parallel size
        kw["tensor_parallel_size"] = a.tp
    for key in ("max_model_len", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(a, key, None) is not None:
            kw[key] = getattr(a, key)
    return kw


def _add_engine_options(p) -> None:
    p.add_argument("model", metavar="MODEL", help="HF model directory, .gguf file or .kiln LLM engine")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's; float32 on CPU), bf16, fp16, fp32")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), bf16, fp8, int8 (8-bit caches "
                   "need calibrated scales: those a .kiln engine carries, or --calib)")
    p.add_argument("--calib", metavar="TEXT", help="text file to calibrate 8-bit KV scales on")
    p.add_argument("--weights", choices=["none", "fp8", "int8"], help="quantize the weights at load (engines "
                   "built by `kiln llm build` carry theirs, including the calibrated w8a8 and int4-awq)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--num-kv-blocks", type=int, help="KV blocks in the pool (default: from free GPU memory)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step (default 8192)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, metavar="N",
                   help="split the model over N processes / GPUs (default: 1, or what the .kiln engine was built for)")
    p.add_argument("--verify-key", "--verifyKey", dest="verify_key", metavar="KEYFILE",
                   help="refuse MODEL unless it is a .kiln LLM engine signed with this key (kiln llm build --sign)")


def cmd_generate(a) -> int:
    from kiln.llm.engine import LLM
    from kiln.llm.sampling import SamplingParams

    if a.prompt is None and a.prompt_ids is None:
        raise InputError("give --prompt TEXT or --promptIds ID,ID,...")
    if a.prompt_ids is not None:
        try:
            prompt = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--promptIds {a.prompt_ids!r}: expected comma-separated integers.") from None
    else:
        prompt = a.prompt
    params = {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
              "seed": a.seed, "stop": a.stop or None, "ignore_eos": a.ignore_eos}
    for item in a.sampling or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InputError(f"--sampling {item!r}: expected KEY=VALUE.")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    sp = SamplingParams.from_dict(params)
    llm = LLM(a.model, **_engine_kwargs(a))
    if a.chat:
        if not isinstance(prompt, str):
            raise InputError("--chat takes --prompt TEXT, not --promptIds.")
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    out = None
    if a.json:
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        c = out.outputs[0]
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                          "prompt_token_ids": out.prompt_token_ids}))
    else:
        shown = 0
        for out in llm.stream(prompt, sp):
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        sys.stdout.write("\n")
    stats = llm.llm_engine.stats()
    llm.shutdown()
    if stats["kv_blocks_free"] != stats["kv_blocks_total"]:  # a bug, never a user error
        raise RuntimeError(f"KV blocks leaked: {stats}")
    return 0


def cmd_bench(a) -> int:
    from kiln.llm import benchmark as bm
    from kiln.llm.engine import LLMEngine

    for name in ("input_len", "output_len", "batch_size", "num_prompts"):
        if getattr(a, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0.")
    kw = _engine_kwargs(a)
    kw["max_num_seqs"] = a.batch_size
    engine = LLMEngine.from_model(a.model, **kw)
    vocab = engine.model_config.vocab_size
    if a.mix == "sharegpt":
        pairs = bm.sharegpt_like_lengths(a.num_prompts, engine.max_model_len)
    else:
        if a.input_len + a.output_len > engine.max_model_len:
            raise ConfigError(f"--inputLen + --outputLen = {a.input_len + a.output_len} exceeds the context "
                              f"({engine.max_model_len}).")
        pairs = [(a.input_len, a.output_len)] * a.num_prompts
    prompts = bm.random_prompts(vocab, [i for i, _ in pairs])
    out_lens = [o for _, o in pairs]
    bm.run_requests(engine, prompts[:min(2, len(prompts))], [4] * min(2, len(prompts)))  # warm-up
    with bm.HostPhases(engine) as phases:
        run = bm.run_requests(engine, prompts, out_lens, time_limit_s=a.time_limit)
    run["host_phases_us_per_step"] = phases.per_step(run["steps"], run["wall_s"])
    batch = min(a.batch_size, a.num_prompts)
    if engine.runner.graphs and engine.runner._bucket(batch) and run["decode_step_ms"]:
        run["graph_replay_ms"] = bm.graph_replay_ms(engine, batch)
        run["host_fraction_of_step"] = 1 - run["graph_replay_ms"] / run["decode_step_ms"]
    result = {"model": str(a.model), "device": str(engine.device), "batch_size": a.batch_size,
              "num_prompts": a.num_prompts, "mix": a.mix or "fixed", "input_len": a.input_len,
              "output_len": a.output_len, "kiln": run}
    if engine.device.type == "cuda":
        avg_ctx = sum(i + o / 2 for i, o in pairs) / len(pairs)
        result["roofline"] = bm.roofline(engine, min(a.batch_size, a.num_prompts), avg_ctx,
                                         bm.copy_bandwidth(engine.device))
        result["roofline"]["fraction"] = result["kiln"]["output_tok_s"] / result["roofline"]["roofline_tok_s"]
    if a.baseline in ("hf", "hf-compile"):
        try:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(
                a.model, dtype=engine.model.dtype).to(engine.device).eval()
            if a.mix == "sharegpt":
                raise ConfigError("--baseline hf runs fixed lengths only (drop --mix).")
            result["hf"] = bm.hf_generate_baseline(hf, prompts, a.output_len, a.batch_size,
                                                   static_compiled=a.baseline == "hf-compile")
            result["speedup_vs_hf"] = result["kiln"]["output_tok_s"] / result["hf"]["output_tok_s"]
        except Exception as e:  # the baseline failing must not hide Kiln's numbers
            result["hf"] = {"error": f"{type(e).__name__}: {e}"}
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(render_bench(result))
    return 0


def render_bench(r: dict) -> str:
    k = r["kiln"]

    def f(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    shape = "ShareGPT-like mix" if r["mix"] == "sharegpt" else f"{r['input_len']} in / {r['output_len']} out"
    lines = [f"model {r['model']} on {r['device']}: batch {r['batch_size']}, {r['num_prompts']} prompts, {shape}",
             f"  throughput   {k['output_tok_s']:.1f} output tok/s ({k['output_tokens']} tokens in "
             f"{k['wall_s']:.2f} s)",
             f"  TTFT         p50 {f(k['ttft_ms_p50'])} ms   p99 {f(k['ttft_ms_p99'])} ms",
             f"  TPOT         p50 {f(k['tpot_ms_p50'], '.2f')} ms   p99 {f(k['tpot_ms_p99'], '.2f')} ms",
             f"  e2e          p50 {f(k['e2e_ms_p50'])} ms   p99 {f(k['e2e_ms_p99'])} ms",
             f"  decode step  {f(k['decode_step_ms'], '.2f')} ms (CUDA graphs at {k['cuda_graphs'] or 'none'})"]
    if k.get("host_fraction_of_step") is not None:
        lines.append(f"  host share   {100 * k['host_fraction_of_step']:.0f}% of the decode step (its CUDA graph "
                     f"{k['graph_replay_ms']:.2f} ms on the GPU)")
    if k.get("cut"):
        lines.append(f"  cut          at --time-limit: {k['finished']} of {k['requests']} requests finished")
    if "roofline" in r:
        rf = r["roofline"]
        lines.append(f"  roofline     {rf['roofline_tok_s']:.1f} tok/s ({rf['weight_bytes'] / 1e9:.2f} GB weights + "
                     f"{rf['kv_bytes_per_step'] / 1e9:.3f} GB KV a step at {rf['bandwidth_GBs']:.0f} GB/s): "
                     f"{100 * rf['fraction']:.1f}% reached")
    if "hf" in r:
        h = r["hf"]
        if "error" in h:
            lines.append(f"  HF generate  failed: {h['error']}")
        else:
            lines.append(f"  HF generate  {h['output_tok_s']:.1f} output tok/s ({h['mode']}): Kiln "
                         f"{r['speedup_vs_hf']:.2f}x")
    return "\n".join(lines)


def add_command(sub) -> argparse.ArgumentParser:
    """Registers `kiln llm` and its subcommands on the top-level subparsers."""
    p = sub.add_parser("llm", help="decoder LLMs: generate, bench (and build, perplexity)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    llm_sub = p.add_subparsers(dest="llm_command", required=True)

    g = llm_sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    _add_engine_options(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling", action="append", metavar="KEY=VALUE",
                   help="any other SamplingParams field, e.g. min_p=0.05 (unknown keys are refused)")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.set_defaults(func=cmd_generate)

    b = llm_sub.add_parser("bench", help="throughput, TTFT, TPOT, e2e latency and the HBM roofline")
    _add_engine_options(b)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (max_num_seqs)")
    b.add_argument("--num-prompts", type=int, default=None, help="requests (default: the batch size)")
    b.add_argument("--mix", choices=["sharegpt"], help="ShareGPT-like (synthetic) input/output length mix")
    b.add_argument("--baseline", choices=["hf", "hf-compile"], help="also time transformers' generate in the run: "
                   "eager, or with its static cache under torch.compile (compile untimed)")
    b.add_argument("--time-limit", type=float, metavar="SECONDS", help="stop the timed run after this long and "
                   "measure what ran (the rest is aborted)")
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.set_defaults(func=_bench_defaults)

    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "add_llm_command"):
            module.add_llm_command(llm_sub)
    return p


def _bench_defaults(a) -> int:
    if a.num_prompts is None:
        a.num_prompts = a.batch_size
    return cmd_bench(a)
