"""The streams' text made in the server process from the engine's token ids, one batched decode per step.

The engine process runs its served requests with SamplingParams.detokenize False (unless stop strings need
the text there), so its step loop does no string work; as vLLM's API server does, this process turns each
step's new token ids into text. `StreamDetokenizer.fill(deltas)` gives one step's Deltas (async_engine.py)
their text, `texts(request ids, token ids)` the text of its plain streams' single tokens: kiln.llm.tokenizer.IncrementalDetokenizer's algorithm, token by token per stream (a window of
tokens before the new ones decoded, the text past the window's prefix emitted, a trailing U+FFFD held back
until its character completes, the rest flushed at the end), but each round of decodes over every stream of
the step is one `decode_batch` call of the `tokenizers` object instead of two calls per stream.
"""

from __future__ import annotations

from .async_engine import C_FINISH, C_IDS, C_INDEX, C_STOP, C_TEXT, CHOICES, RID

_WINDOW = 4  # prompt tokens before the first new one: IncrementalDetokenizer's starting window
_REPLACEMENT = "\ufffd"


class _Stream:
    __slots__ = ("ids", "prefix", "read", "text")

    def __init__(self, prompt_ids: list[int]):
        self.ids = list(prompt_ids[-_WINDOW:])
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""  # this step's new text


class StreamDetokenizer:
    """Per stream (request id, choice index): the token window IncrementalDetokenizer keeps. `open` a request
    when it is submitted, `fill` each step's deltas, `close` an aborted one (a finished one closes itself)."""

    def __init__(self, tokenizer):
        """tokenizer: kiln.llm.tokenizer.Tokenizer (its `tokenizers` object and special tokens)."""
        self._tok = tokenizer._tok
        self._is_special = tokenizer.is_special
        self._requests: dict[str, tuple[list[int], bool, dict]] = {}  # rid -> (prompt ids, skip, {index: _Stream})

    def open(self, request_id: str, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._requests[request_id] = (prompt_ids, skip_special_tokens, {})

    def close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def texts(self, request_ids: list[str], token_ids: list[int]) -> list[str]:
        """The text each of a step's plain streams (choice 0, one new token, not finishing: step_frames.py's
        tokens) adds, in order; "" for a request not opened."""
        requests = self._requests
        work, order = [], []
        for rid, tok in zip(request_ids, token_ids):
            req = requests.get(rid)
            if req is None:
                order.append(None)
                continue
            streams = req[2]
            st = streams.get(0)
            if st is None:
                st = streams[0] = _Stream(req[0])
            work.append((st, req[1], (tok,), False))
            order.append(st)
        if work:
            self._decode(work)
        out = []
        for st in order:
            if st is None:
                out.append("")
            else:
                out.append(st.text)
                st.text = ""
        return out

    def fill(self, deltas: list) -> list:
        """One step's deltas (a request at most once) with each choice's text made here; deltas of requests not
        opened pass unchanged."""
        work = []  # (stream, token ids to add, flush at the end)
        for d in deltas:
            req = self._requests.get(d[RID])
            if req is None:
                continue
            prompt, skip, streams = req
            for c in d[CHOICES]:
                st = streams.get(c[C_INDEX])
                if st is None:
                    st = streams[c[C_INDEX]] = _Stream(prompt)
                ids, finish = c[C_IDS], c[C_FINISH]
                # A special stop token ends the text unseen (LLMEngine._append_token: it is not detokenized).
                stop = c[C_STOP]
                if (ids and finish == "stop" and skip and isinstance(stop, int) and ids[-1] == stop
                        and self._is_special(stop)):
                    ids = ids[:-1]
                work.append((st, skip, ids, finish is not None))
        if not work:
            return deltas
        self._decode(work)
        out = []
        for d in deltas:
            req = self._requests.get(d[RID])
            if req is None:
                out.append(d)
                continue
            streams = req[2]
            choices = []
            for c in d[CHOICES]:
                st = streams[c[C_INDEX]]
                choices.append((*c[:C_TEXT], st.text, *c[C_TEXT + 1:]))
                st.text = ""
                if c[C_FINISH] is not None:
                    del streams[c[C_INDEX]]
            if d[2]:  # the request finished: every choice did
                del self._requests[d[RID]]
            out.append((*d[:CHOICES], choices))
        return out

    def _decode(self, work: list) -> None:
        # Round k adds the k-th new token of every stream that has one (a step adds one, so one round).
        rounds = max(len(ids) for _, _, ids, _ in work)
        for k in range(rounds):
            items = []
            for st, skip, ids, _ in work:
                if k < len(ids):
                    st.ids.append(ids[k])
                    items.append((st, skip))
            for st, prefix, full in self._windows(items):
                if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
                    st.text += full[len(prefix):]
                    st.prefix, st.read = st.read, len(st.ids)
                    self._trim(st)
        flushed = [(st, skip) for st, skip, _, flush in work if flush]
        for st, prefix, full in self._windows(flushed):
            st.text += full[len(prefix):]
            st.prefix = st.read = len(st.ids)

    def _windows(self, items: list) -> list:
        """(stream, decoded prefix window, decoded window to the end) of each item, in decode_batch calls."""
        if not items:
            return []
        out = []
        for skip in {s for _, s in items}:
            group = [st for st, s in items if s == skip]
            prefixes = self._tok.decode_batch([st.ids[st.prefix:st.read] for st in group], skip_special_tokens=skip)
            fulls = self._tok.decode_batch([st.ids[st.prefix:] for st in group], skip_special_tokens=skip)
            out += zip(group, prefixes, fulls)
        return out

    @staticmethod
    def _trim(st: _Stream) -> None:
        # Tokens before the window are never decoded again.
        if st.prefix:
            del st.ids[:st.prefix]
            st.read -= st.prefix
            st.prefix = 0
