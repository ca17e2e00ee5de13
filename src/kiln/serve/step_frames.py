"""What one engine step produced for every served stream, as the engine process sends it: few objects per step.

The engine process encodes each step (`StepEncoder`), one part for each HTTP process it serves, and each
HTTP process decodes its part (`StepDecoder`) into kiln/serve/async_engine.py's Deltas, the same a DeltaMaker
makes of the engine's "delta" RequestOutputs. A step's part of a frame is two pieces:

    tokens   (request ids, token ids): plain streams that got one token and did not finish, as two flat lists
             (nearly every stream of nearly every step)
    deltas   [Delta] with no prompt: everything else (a stream's last delta, a request of n > 1 or with
             logprobs or stop strings)

A plain stream (one sequence, no logprobs, no stop strings, no text made in the engine) runs with output_kind
"final_only", so the engine builds no output for it until it finishes; each step its new token is read off its
Sequence. The others run with output_kind "delta". The server attaches each request's prompt token ids (it
sent them) to the request's first delta.
"""

from __future__ import annotations

from .async_engine import STREAMED


def is_plain(fields: dict) -> bool:
    """A request (its SamplingParams fields) whose stream is read off its sequence."""
    return fields["n"] == 1 and fields["logprobs"] is None and not fields["stop"] and not fields["detokenize"]


class StepEncoder:
    """In the engine process: its served requests, which HTTP process (client) each came from, and what each has
    been sent."""

    def __init__(self, engine, clients: int = 1):
        self.engine = engine
        # per client: request id -> [its Sequence, tokens sent (prompt included)]
        self._plain: list[dict[str, list]] = [{} for _ in range(clients)]
        self._delta: set[str] = set()  # requests of output_kind "delta"
        self._owner: dict[str, int] = {}  # every served request -> its client

    @staticmethod
    def output_kind(fields: dict) -> str:
        return "final_only" if is_plain(fields) else STREAMED

    def add(self, request_id: str, fields: dict, client: int = 0) -> None:
        """After engine.add_request(request_id, ..., output_kind=output_kind(fields))."""
        self._owner[request_id] = client
        if is_plain(fields):
            seq = self.engine.requests[request_id].seqs[0]
            self._plain[client][request_id] = [seq, len(seq.token_ids)]
        else:
            self._delta.add(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def owned_by(self, client: int) -> list[str]:
        return [rid for rid, c in self._owner.items() if c == client]

    def forget(self, request_id: str) -> None:
        client = self._owner.pop(request_id, None)
        if client is not None:
            self._plain[client].pop(request_id, None)
            self._delta.discard(request_id)

    def clear(self) -> None:
        self._owner.clear()
        self._delta.clear()
        for plain in self._plain:
            plain.clear()

    def encode(self, outputs: list) -> list[tuple[tuple[list, list], list]]:
        """Per client, ((request ids, token ids), deltas) of one step, from its outputs (engine.step())."""
        owner, delta = self._owner, self._delta
        deltas: list[list] = [[] for _ in self._plain]
        for out in outputs:
            rid = out.request_id
            client = owner.get(rid)
            if client is None:
                continue
            st = self._plain[client].pop(rid, None)
            if st is not None:  # a plain stream's only output: it finished
                del owner[rid]
                seq, sent = st
                deltas[client].append((rid, None, True, [(0, "", seq.token_ids[sent:], seq.finish_reason,
                                                          seq.stop_reason, None)]))
            elif rid in delta:
                if out.finished:
                    delta.discard(rid)
                    del owner[rid]
                deltas[client].append((rid, None, out.finished, [(c.index, c.text, c.token_ids, c.finish_reason,
                                                                  c.stop_reason, c.logprobs) for c in out.outputs]))
        frames = []
        for plain, mine in zip(self._plain, deltas):
            rids, ids = [], []
            for rid, st in plain.items():
                seq, sent = st
                toks = seq.token_ids
                n = len(toks)
                if n == sent + 1:
                    rids.append(rid)
                    ids.append(toks[sent])
                    st[1] = n
                elif n > sent:
                    mine.append((rid, None, False, [(0, "", toks[sent:], None, None, None)]))
                    st[1] = n
            frames.append(((rids, ids), mine))
        return frames


class StepDecoder:
    """In the server process: a step's (tokens, deltas) into Deltas, each request's prompt on its first."""

    def __init__(self):
        self._prompts: dict[str, list[int]] = {}  # request id -> prompt token ids, until its first delta

    def expect(self, request_id: str, prompt_ids: list[int]) -> None:
        self._prompts[request_id] = prompt_ids

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    def decode(self, tokens: tuple[list, list], deltas: list, texts: list[str] | None = None) -> list:
        """texts: the text of each of tokens' streams (made in this process: detokenize.py), else ""."""
        prompts = self._prompts
        rids, ids = tokens
        out = [(rid, prompts.pop(rid, None), False, [(0, text, [tok], None, None, None)])
               for rid, tok, text in zip(rids, ids, texts if texts is not None else [""] * len(rids))]
        for d in deltas:
            out.append((d[0], prompts.pop(d[0], None), d[2], d[3]))
        return out
