"""Tokenizer: a `tokenizers.Tokenizer` with the model's special tokens and chat template.

Built from a Hugging Face tokenizer.json (+ tokenizer_config.json) or, for GGUF files, from a `tokenizers`
object and metadata the GGUF loader supplies. Chat templates render in jinja2's sandboxed environment.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import ModelError


def _token_str(v):
    # tokenizer_config.json holds special tokens as strings or as {"content": ...} objects.
    if isinstance(v, dict):
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, tok, *, bos_token: str | None = None, eos_tokens: list[str] | tuple = (),
                 eos_token_ids: list[int] | tuple = (), chat_template: str | None = None,
                 add_bos_token: bool | None = None, source: str = "tokenizer"):
        self._tok = tok
        self.source = source
        self.bos_token = bos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        ids = set(eos_token_ids)
        for t in eos_tokens:
            i = tok.token_to_id(t)
            if i is None:
                raise ModelError(f"{source}: eos token {t!r} is not in the vocabulary.")
            ids.add(i)
        self.eos_token_ids: set[int] = ids
        self.eos_token = eos_tokens[0] if eos_tokens else (tok.id_to_token(min(ids)) if ids else None)
        self.chat_template = chat_template
        # When the tokenizer's own post-processor does not add BOS but the config asks for it, prepend it here.
        self._prepend_bos = False
        if add_bos_token and self.bos_token_id is not None:
            probe = tok.encode("a", add_special_tokens=True).ids
            self._prepend_bos = not probe or probe[0] != self.bos_token_id
        self._special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._template = None

    @classmethod
    def from_file(cls, tokenizer_json, tokenizer_config_json=None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(tokenizer_json)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelError(f"{path}: not a readable tokenizer.json ({e}).") from None
        cfg = {}
        if tokenizer_config_json is not None and Path(tokenizer_config_json).exists():
            try:
                cfg = json.loads(Path(tokenizer_config_json).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ModelError(f"{tokenizer_config_json}: not valid JSON ({e}).") from None
        eos = _token_str(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tok, bos_token=_token_str(cfg.get("bos_token")), eos_tokens=[eos] if eos else [],
                   chat_template=template, add_bos_token=cfg.get("add_bos_token"), source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ModelError(f"{self.source}: the tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template').")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg):
                raise TemplateError(msg)

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything each step.

    Decodes a short window of tokens before the new ones and emits only the text after the window's prefix;
    a trailing U+FFFD (a multi-byte character split across tokens) is held back until it completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: emit text still held back (an incomplete character stays as U+FFFD)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
