"""OpenAI's HTTP API, the part Kiln serves: request bodies in, engine requests and response JSON out.

Request bodies are checked field by field; anything unknown, mistyped or out of range is an `APIError`
(400 by default) whose JSON body is OpenAI's: {"error": {"message", "type", "param", "code"}}. Beyond
OpenAI's fields, vLLM's sampling extras are accepted (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, include_stop_str_in_output), and `return_token_ids`
adds each choice's generated token ids (and the prompt's) to the response, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..errors import KilnError
from ..llm.sampling import SamplingParams

MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_SAMPLING = {  # body field -> (SamplingParams field, accepted types)
    "n": ("n", int), "temperature": ("temperature", (int, float)), "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", int), "min_p": ("min_p", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "presence_penalty": ("presence_penalty", (int, float)), "frequency_penalty": ("frequency_penalty", (int, float)),
    "seed": ("seed", int), "ignore_eos": ("ignore_eos", bool), "min_tokens": ("min_tokens", int),
    "stop_token_ids": ("stop_token_ids", list), "skip_special_tokens": ("skip_special_tokens", bool),
    "include_stop_str_in_output": ("include_stop_str_in_output", bool),
}
_COMMON = {"model", "max_tokens", "stream", "stream_options", "stop", "user", "return_token_ids", *_SAMPLING}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


@dataclass
class GenerationRequest:
    """One HTTP request, ready for the engine: one engine request per prompt, each with n choices."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token, None = no logprobs
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def _is(v, types) -> bool:
    if isinstance(v, bool):
        return types is bool or (isinstance(types, tuple) and bool in types)
    return isinstance(v, types)


def _check_fields(body, allowed: set[str], what: str) -> None:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}.")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(f"unknown field(s) {unknown} for {what}; known fields: {sorted(allowed)}.", param=unknown[0])


def _sampling(body: dict, max_tokens: int, extra: dict | None = None) -> SamplingParams:
    kwargs = {"max_tokens": max_tokens, **(extra or {})}
    for key, (name, types) in _SAMPLING.items():
        if body.get(key) is None:
            continue
        if not _is(body[key], types):
            raise APIError(f"'{key}' must be of type {getattr(types, '__name__', 'number')}, "
                           f"not {type(body[key]).__name__}.", param=key)
        kwargs[name] = body[key]
    if kwargs.get("n", 1) > MAX_N or kwargs.get("n", 1) < 1:
        raise APIError(f"'n' = {kwargs['n']} is out of range: this server returns 1 to {MAX_N} choices.", param="n")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise APIError("'stop' must be a string or a list of at most 16 strings.", param="stop")
        kwargs["stop"] = [s for s in stop if s] or None
    try:
        return SamplingParams(**kwargs)
    except KilnError as e:  # SamplingParams names the field in its message
        raise APIError(str(e)) from None


def _max_tokens(body: dict, key: str, default: int | None, prompt_len: int, context: int) -> int:
    value = body.get(key)
    if value is None:
        value = default if default is not None else context - prompt_len
    if not _is(value, int):
        raise APIError(f"'{key}' must be an integer, not {type(value).__name__}.", param=key)
    if value < 1:
        raise APIError(f"'{key}' = {value} is out of range: it must be at least 1.", param=key)
    if prompt_len + value > context:
        raise APIError(f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{prompt_len + value} tokens ({prompt_len} in the prompt, {value} for the completion). "
                       f"Reduce the prompt or '{key}'.", param=key, code="context_length_exceeded")
    return value


def _stream_options(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise APIError("'stream_options' must be an object with 'include_usage'.", param="stream_options")
    if not body.get("stream"):
        raise APIError("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return bool(opts.get("include_usage"))


def _common(body: dict, model: str) -> None:
    requested = body.get("model")
    if not isinstance(requested, str):
        raise APIError("'model' is required and must be a string.", param="model")
    if requested != model:
        raise APIError(f"The model '{requested}' does not exist; this server serves '{model}'.", status=404,
                       param="model", code="model_not_found")
    for key in ("stream", "return_token_ids"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise APIError(f"'{key}' must be a boolean.", param=key)


def _encode_prompts(prompt, tokenizer, vocab: int) -> list[list[int]]:
    def ids_of(p, where):
        if isinstance(p, str):
            if not p:
                raise APIError(f"{where} is empty.", param="prompt")
            return tokenizer.encode(p)
        if isinstance(p, list) and p and all(_is(t, int) for t in p):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise APIError(f"{where} holds token id {bad[0]}, outside the vocabulary (0..{vocab - 1}).",
                               param="prompt")
            return list(p)
        raise APIError(f"{where} must be a non-empty string or list of token ids.", param="prompt")

    if prompt is None:
        raise APIError("'prompt' is required.", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 256:
            raise APIError(f"'prompt' holds {len(prompt)} prompts; at most 256 per request.", param="prompt")
        return [ids_of(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [ids_of(prompt, "'prompt'")]


def parse_completion(body, model: str, tokenizer, vocab: int, context: int) -> GenerationRequest:
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    _common(body, model)
    if body.get("echo"):
        raise APIError("'echo' is not supported by this server.", param="echo")
    if body.get("suffix"):
        raise APIError("'suffix' is not supported by this server.", param="suffix")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise APIError(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}.", param="logprobs")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise APIError("'best_of' other than 'n' is not supported by this server.", param="best_of")
    prompts = _encode_prompts(body.get("prompt"), tokenizer, vocab)
    longest = max(len(p) for p in prompts)
    max_tokens = _max_tokens(body, "max_tokens", 16, longest, context)
    params = _sampling(body, max_tokens, {"logprobs": logprobs} if logprobs is not None else None)
    return GenerationRequest("completion", model, prompts, params, bool(body.get("stream")), _stream_options(body),
                             logprobs, bool(body.get("return_token_ids")))


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's message roles


def _message_text(m, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(f"messages[{i}] must be an object with a string 'role'.", param="messages")
    if m["role"] not in ROLES:
        raise APIError(f"messages[{i}].role {m['role'][:40]!r} is not one of {', '.join(ROLES)}.", param="messages")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI's content parts: only text ones here
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"messages[{i}].content: only text parts are supported.", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise APIError(f"messages[{i}].content must be a string or a list of text parts.", param="messages")
    return {**{k: v for k, v in m.items() if k not in ("content",)}, "content": content}


def parse_chat(body, model: str, tokenizer, vocab: int, context: int) -> GenerationRequest:
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    _common(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' is required and must be a non-empty list.", param="messages")
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except KilnError as e:
        raise APIError(f"the model's chat template refused these messages: {e}", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens itself
    logprobs = None
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise APIError("'logprobs' must be a boolean.", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _is(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise APIError(f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}.", param="top_logprobs")
    if body.get("logprobs"):
        logprobs = top or 0
    elif top is not None:
        raise APIError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, key, None, len(ids), context)
    params = _sampling(body, max_tokens, {"logprobs": logprobs} if logprobs is not None else None)
    return GenerationRequest("chat", model, [ids], params, bool(body.get("stream")), _stream_options(body),
                             logprobs, bool(body.get("return_token_ids")))


# --- responses ------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], offset: int) -> dict:
    """OpenAI's legacy completions logprobs for new tokens (text_offset counted from `offset`)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, lp in zip(token_ids, logprobs):
        s = tokenizer.decode([tok], skip_special_tokens=False)
        tokens.append(s)
        token_lps.append(lp.get(tok))
        top = {}
        for t, v in sorted(lp.items(), key=lambda kv: -kv[1]):  # two ids may decode alike: keep the likelier
            top.setdefault(tokenizer.decode([t], skip_special_tokens=False), v)
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], top: int) -> dict:
    def entry(t, v):
        s = tokenizer.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    content = []
    for tok, lp in zip(token_ids, logprobs):
        alts = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(tok, lp.get(tok)), "top_logprobs": [entry(t, v) for t, v in alts]})
    return {"content": content}
