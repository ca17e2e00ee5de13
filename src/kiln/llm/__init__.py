"""Kiln-LLM: decoder models with a paged KV cache and in-flight batching.

    from kiln.llm import LLM, SamplingParams
    llm = LLM("path/to/hf-dir-or.gguf-or.kiln", device="cuda")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from kiln.llm.engine import LLM, CompletionOutput, LLMEngine, RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
