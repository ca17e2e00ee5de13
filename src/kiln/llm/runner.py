"""The model runner: the KV pool, one step's input tensors and attention metadata, the forward, the sampler.

On CUDA, decode-only steps replay CUDA graphs captured at bucketed batch sizes (1, 2, 4, 8, 16, 32, 64, ...)
over static buffers; a batch is padded up to its bucket with rows that write nowhere (slot -1). Steps with
prefill, batches above the largest bucket, and any capture that fails run eagerly.

A step is split in two so the engine can overlap host work with the GPU: `launch` prepares the inputs, queues
the forward and, for greedy batches, the argmax and the copy of the token ids to pinned host memory, without
waiting; `collect` waits for those ids (the one sync of a step) or runs the sampler. `execute` is both.

Under tensor parallelism every rank holds a runner over its model shard and its KV heads; rank 0 prepares each
step (`prepare`), hands it to `on_step` (which sends it to the other ranks), and every rank runs it
(`run_inputs`): the same bucket, the same collectives, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import ConfigError
from kiln.llm.attention import AttentionMetadata, LayerCache, key_offset
from kiln.llm.model import DecoderModel
from kiln.llm.sampling import Sampler
from kiln.llm.scheduler import ScheduledStep

KV_DTYPES = {"auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
             "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_DTYPES:
        raise ConfigError(f"kv_cache_dtype {name!r} is not supported; choose one of {sorted(KV_DTYPES)}.")
    return KV_DTYPES[name] or model_dtype


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes decode graphs are captured at: powers of two up to 128, then every 64 (a batch pads up to its
    bucket, and above 128 rows padding to the next power of two would waste up to half the step), and
    max_num_seqs itself."""
    sizes, b = [], 1
    while b < min(max_num_seqs, 128):
        sizes.append(b)
        b *= 2
    b = 128
    while b < max_num_seqs:
        sizes.append(b)
        b += 64
    sizes.append(max_num_seqs)
    return sizes


@dataclass
class StepInputs:
    """One step's host-side inputs: what rank 0 computes and sends to the other ranks."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    starts: list[int]  # query_start_loc
    seq_lens: list[int]
    # Block tables: each sequence's own list (unpadded, not copied) on one rank; padded to one width where the
    # step is sent to other ranks (tp_workers.encode_step) and in what they receive.
    tables: list[list[int]]
    sample_rows: list[int]  # rows whose logits are needed
    max_query_len: int
    decode_only: bool


@dataclass
class LaunchedStep:
    """A step queued on the device: what `collect` needs to return its tokens."""

    samplers: list  # the sequences that sample this step
    logits: torch.Tensor | None  # their logits, when the sampler runs at collect
    token_ids: torch.Tensor | None  # greedy batches: the argmax, on the host once `ready` has passed
    ready: object = None  # a CUDA event recorded after the copy of token_ids (None: already there)
    device_tokens: torch.Tensor | None = None  # greedy batches: the argmax on the device (feeds launch_fed)


class ModelRunner:
    def __init__(self, model: DecoderModel, *, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None, max_num_seqs: int, max_model_len: int,
                 use_cuda_graphs: bool = True, graph_argmax: bool = False):
        """graph_argmax: decode graphs also take each row's argmax (kernels/argmax.py, one launch spread over the
        GPU, inside the graph), which greedy steps use instead of torch.argmax launched after the replay."""
        self.model = model
        self.cfg = model.cfg
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        nkv = model.num_kv_heads  # this rank's KV heads (all of them without tensor parallelism)
        shape = (num_blocks, block_size, nkv, self.cfg.head_dim)
        self.caches = []
        for n in range(self.cfg.num_layers):
            ks, vs = kv_scales[n] if kv_scales is not None else (None, None)
            ko = key_offset(kv_scales[n]) if kv_scales is not None else None
            if ks is not None:
                ks, vs = (self._local_scale(s).to(self.device, torch.float32).expand(nkv).contiguous()
                          for s in (ks, vs))
            if ko is not None:
                ko = self._local_scale(ko).to(self.device, torch.float32).reshape(nkv, self.cfg.head_dim)
            self.caches.append(LayerCache(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                                          torch.zeros(shape, dtype=kv_dtype, device=self.device), ks, vs,
                                          ko.contiguous() if ko is not None else None))
        self.sampler = Sampler()
        # Greedy steps' token ids arrive here by an asynchronous copy (on CUDA; the CPU's argmax is already there).
        cuda = self.device.type == "cuda"
        # Two of each: with launch_fed a step is queued before the previous one's ids are read.
        self._tokens_host = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if cuda else None
        self._tokens_ready = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._tokens_turn = 0
        self.on_step = None  # rank 0 under tensor parallelism: sends each step's inputs to the other ranks
        self.graphs: dict = {}  # bucket batch size -> callable running a decode step from the static buffers
        # A list to time every graph replay on the GPU into ((bucket, start, end) CUDA events); None: untimed.
        self.graph_times: list | None = None
        self.graph_error: str | None = None
        self.graph_argmax = graph_argmax
        self.step_tokens: torch.Tensor | None = None  # the last run_inputs' argmax rows, when its graph took them
        if use_cuda_graphs and self.device.type == "cuda":
            self.capture_graphs(max_num_seqs)

    def _local_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """A per-KV-head scale [num_kv_heads] or key offset [num_kv_heads, head_dim] of the full model -> this
        rank's KV heads (one-value scales stay as they are)."""
        ids = self.model.kv_head_ids
        if ids is None or scale.numel() == 1:
            return scale
        return scale.reshape(self.cfg.num_kv_heads, -1)[torch.tensor(ids)].squeeze(-1)

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token on this rank."""
        return 2 * self.cfg.num_layers * self.model.num_kv_heads * self.cfg.head_dim * self.caches[0].k.element_size()

    # ----------------------------------------------------------------------------------------------------------
    def prepare(self, step: ScheduledStep) -> StepInputs:
        """Host-side inputs of one step: input ids, positions, metadata, and the rows whose logits are needed."""
        bs = self.block_size
        if step.is_decode_only:  # one token a sequence, and every sequence samples
            ids, positions, slots, seq_lens = [], [], [], []
            for seq in step.seqs:
                c = seq.num_computed_tokens
                ids.append(seq.token_ids[c])
                positions.append(c)
                slots.append(seq.block_table[c // bs] * bs + c % bs)
                seq_lens.append(c + 1)
            n = len(ids)
            return StepInputs(ids, positions, slots, list(range(n + 1)), seq_lens, self._tables(step),
                              list(range(n)), 1, True)
        ids, positions, slots, starts, seq_lens, sample_rows = [], [], [], [0], [], []
        row = 0
        for seq, n in zip(step.seqs, step.num_new_tokens):
            c = seq.num_computed_tokens
            end = c + n
            table = seq.block_table
            if n == 1:  # a decoding sequence, beside prefill chunks
                ids.append(seq.token_ids[c])
                positions.append(c)
                slots.append(table[c // bs] * bs + c % bs)
            else:
                ids.extend(seq.token_ids[c:end])
                positions.extend(range(c, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(c, end)])
            row += n
            starts.append(row)
            seq_lens.append(end)
            if end == len(seq.token_ids):  # this step reaches its end: it samples
                sample_rows.append(row - 1)
        return StepInputs(ids, positions, slots, starts, seq_lens, self._tables(step), sample_rows,
                          max(step.num_new_tokens), False)

    def _tables(self, step: ScheduledStep) -> list[list[int]]:
        tables = [s.block_table for s in step.seqs]
        if self.on_step is not None:  # sent to other ranks as one padded array
            width = max(len(t) for t in tables)
            tables = [t + [0] * (width - len(t)) for t in tables]
        return tables

    @torch.inference_mode()
    def execute(self, step: ScheduledStep) -> tuple[list, list[int], list]:
        """Runs one step; returns (sequences that sampled, their tokens, their logprobs)."""
        return self.collect(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: ScheduledStep) -> LaunchedStep:
        """Queues one step on the device and returns without waiting for it. One step at a time: collect it
        before launching the next (greedy batches share one pinned buffer for their token ids)."""
        inputs = self.prepare(step)
        if self.on_step is not None:
            self.on_step(inputs)
        logits = self.run_inputs(inputs)
        tokens, self.step_tokens = self.step_tokens, None
        if len(inputs.sample_rows) == len(step.seqs):  # every sequence samples (always in decode-only steps)
            samplers = step.seqs
        else:
            samplers = [s for s, n in zip(step.seqs, step.num_new_tokens)
                        if s.num_computed_tokens + n == len(s.token_ids)]
        if not samplers:
            return LaunchedStep([], None, None)
        if not self.sampler.plain_greedy(samplers):
            return LaunchedStep(samplers, logits, None)
        return self._argmax(samplers, logits, tokens)

    def _argmax(self, samplers, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> LaunchedStep:
        """Greedy tokens of the sampling rows: `tokens` where the decode graph took them, else torch.argmax."""
        if tokens is None:
            tokens = logits.argmax(dim=-1)
        elif self._tokens_host is None:  # a view of the static buffer, which a step queued next would overwrite
            tokens = tokens.clone()
        if self._tokens_host is None:
            return LaunchedStep(samplers, None, tokens, None, tokens)
        turn = self._tokens_turn = 1 - self._tokens_turn
        host, ready = self._tokens_host[turn][:len(samplers)], self._tokens_ready[turn]
        host.copy_(tokens, non_blocking=True)
        ready.record()
        return LaunchedStep(samplers, None, host, ready, tokens)

    def can_feed(self, batch: int) -> bool:
        """launch_fed applies: decode graphs (or their static step functions) cover the batch, on one rank."""
        return self.on_step is None and not self.model.shard.active and self._bucket(batch) is not None

    @torch.inference_mode()
    def launch_fed(self, step: ScheduledStep, prev: LaunchedStep, rows: list[int]) -> LaunchedStep:
        """Queues a decode step whose input tokens are those `prev` is still computing, taken on the device
        (prev's argmax rows `rows`, in the order of step.seqs), before the host has read them: each sequence's
        position, slot and length are one past what the host knows. Every row is plain greedy."""
        bs, n = self.block_size, len(step.seqs)
        positions, slots, seq_lens = [], [], []
        for seq in step.seqs:
            c = seq.num_computed_tokens + 1  # prev's token goes in at c - 1
            positions.append(c)
            slots.append(seq.block_table[c // bs] * bs + c % bs)
            seq_lens.append(c + 1)
        ids = prev.device_tokens
        if len(rows) != ids.shape[0]:  # rows are increasing: all of them or a subset
            ids = ids.index_select(0, torch.tensor(rows, device=ids.device))
        logits = self._replay(self._bucket(n), [0] * n, positions, slots, seq_lens,
                              [s.block_table for s in step.seqs], ids)
        return self._argmax(step.seqs, logits[:n], self.g_tokens[:n] if self.graph_argmax else None)

    @torch.inference_mode()
    def collect(self, launched: LaunchedStep) -> tuple[list, list[int], list]:
        """Waits for a launched step; returns (sequences that sampled, their tokens, their logprobs)."""
        if launched.token_ids is None:
            if not launched.samplers:
                return [], [], []
            tokens, logprobs = self.sampler(launched.logits, launched.samplers)
            return launched.samplers, tokens, logprobs
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.samplers, launched.token_ids.tolist(), [None] * len(launched.samplers)

    @torch.inference_mode()
    def run_inputs(self, x: StepInputs) -> torch.Tensor | None:
        """The forward of one step and its logits [len(sample_rows), vocab] (None when no row samples)."""
        num_seqs = len(x.seq_lens)
        bucket = self._bucket(num_seqs) if x.decode_only else None
        self.step_tokens = None
        if bucket is not None:
            logits = self._replay(bucket, x.ids, x.positions, x.slots, x.seq_lens, x.tables)
            # Every row is a one-token query; the ones that end their sequence's tokens sample (a one-token
            # prompt chunk mid-prompt does not).
            rows = slice(0, num_seqs) if len(x.sample_rows) == num_seqs else x.sample_rows
            if self.graph_argmax:
                self.step_tokens = self.g_tokens[rows]
            return logits[rows]
        dev = self.device

        def t(v, dtype):
            return torch.tensor(v, dtype=dtype).to(dev, non_blocking=True)

        md = AttentionMetadata(slot_mapping=t(x.slots, torch.int64), query_start_loc=t(x.starts, torch.int32),
                               seq_lens=t(x.seq_lens, torch.int32), block_tables=padded_tables(x.tables).to(dev),
                               max_query_len=x.max_query_len, max_seq_len=max(x.seq_lens))
        hidden = self.model.forward(t(x.ids, torch.int64), t(x.positions, torch.int64), md, self.caches)
        if not x.sample_rows:
            return None
        return self.model.compute_logits(hidden[t(x.sample_rows, torch.int64)])

    # ----------------------------------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int | None:
        for b in sorted(self.graphs):
            if b >= n:
                return b
        return None

    def make_static_buffers(self, max_num_seqs: int) -> None:
        """Inputs of decode steps at fixed addresses (what captured graphs read), sized for the largest bucket,
        and their host-side mirrors (pinned on CUDA): a step writes its inputs into the mirrors and sends them
        in two copies, one per dtype, whatever the batch."""
        dev, n = self.device, max(graph_buckets(max_num_seqs))
        w = self.max_blocks_per_seq
        self.g_i64 = torch.zeros((3, n), dtype=torch.int64, device=dev)  # ids, positions, slots
        self.g_ids, self.g_pos, self.g_slots = self.g_i64[0], self.g_i64[1], self.g_i64[2]
        self.g_slots.fill_(-1)
        self.g_i32 = torch.zeros(n + n * w, dtype=torch.int32, device=dev)  # seq_lens, then the block tables
        self.g_lens, self.g_tables = self.g_i32[:n], self.g_i32[n:].view(n, w)
        self.g_lens.fill_(1)
        self.g_starts = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.g_tokens = torch.zeros(n, dtype=torch.int64, device=dev)  # graph_argmax: each row's argmax
        pin = dev.type == "cuda"
        self.h_i64 = torch.zeros(self.g_i64.shape, dtype=torch.int64, pin_memory=pin).copy_(self.g_i64)
        self.h_i32 = torch.zeros(self.g_i32.shape, dtype=torch.int32, pin_memory=pin).copy_(self.g_i32)
        self._h64, self._h32 = self.h_i64.numpy(), self.h_i32.numpy()
        self._h_lens, self._h_tables = self._h32[:n], self._h32[n:].reshape(n, w)
        # What each row of the host mirror's block tables holds: (the sequence's block-table list, entries
        # written). A sequence's list only grows until its blocks are freed, when it gets a new list, so the
        # list object and a count say which entries of a row are current.
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * n
        self._copies_done = torch.cuda.Event() if pin else None

    def static_decode_step(self, b: int):
        """A function running a decode step of b rows from the static buffers, returning logits [b, vocab]."""
        md = AttentionMetadata(self.g_slots[:b], self.g_starts[:b + 1], self.g_lens[:b], self.g_tables[:b],
                               max_query_len=1, max_seq_len=self.max_model_len)

        def run():
            logits = self.model.compute_logits(self.model.forward(self.g_ids[:b], self.g_pos[:b], md, self.caches))
            if self.graph_argmax:
                from kiln.kernels.argmax import argmax_rows

                argmax_rows(logits, out=self.g_tokens[:b])
            return logits

        return run

    def capture_graphs(self, max_num_seqs: int, buckets: list[int] | None = None) -> None:
        """Captures the decode graphs at every bucket of max_num_seqs, or at `buckets` alone (again, dropping
        any held, after a flag that changes the step such as graph_argmax or the model's fusions)."""
        self.graphs = {}
        self.graph_error = None
        self.make_static_buffers(max_num_seqs)
        pool = None
        try:
            for b in sorted(buckets or graph_buckets(max_num_seqs), reverse=True):
                run = self.static_decode_step(b)
                with torch.inference_mode():
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        run()  # warm up (Triton compiles) outside the capture
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = run()
                pool = graph.pool()
                self.graphs[b] = _Replay(graph, out)
            torch.cuda.synchronize()
        except Exception as e:  # e.g. a kernel that syncs with the host: decode runs eagerly
            self.graphs.clear()
            self.graph_error = f"{type(e).__name__}: {e}"
            try:
                torch.cuda.synchronize()
            except RuntimeError:
                pass
        if self.model.shard.active:
            self._agree_on_graphs()

    def _agree_on_graphs(self) -> None:
        """Under tensor parallelism a step replays on every rank or on none (a graph holds the all-reduces):
        when any rank's capture failed, every rank runs decode eagerly."""
        import torch.distributed as dist

        ok = torch.tensor([1 if self.graphs else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.model.shard.group)
        if not ok.item() and self.graphs:
            self.graphs.clear()
            self.graph_error = "another tensor-parallel rank could not capture its decode graphs"

    def _replay(self, b, ids, positions, slots, seq_lens, tables, device_ids=None):
        """One decode step from the static buffers at bucket b; device_ids: input ids already on the device,
        written over the copied ones."""
        n = len(ids)
        if self._copies_done is not None:
            self._copies_done.synchronize()  # the previous step's copies have left the host mirrors
        h = self._h64
        h[0, :n] = ids
        h[1, :n] = positions
        h[2, :n] = slots
        h[2, n:b] = -1  # padding rows write nowhere
        self._h_lens[:n] = seq_lens
        self._h_lens[n:b] = 1
        rows, h_tables = self._rows, self._h_tables
        # Rank 0 alone reads the sequences' own lists; padded copies (sent or received) are new lists each step,
        # told apart by their contents.
        own = self.on_step is None and self.model.shard.rank == 0
        for i, t in enumerate(tables):  # only entries that changed: a sequence's new block, another sequence
            held, written = rows[i]
            if held is t:
                if written < len(t):
                    h_tables[i, written:len(t)] = t[written:]
            elif own or held != t:
                h_tables[i, :len(t)] = t
            rows[i] = (t, len(t))
        self.g_i64.copy_(self.h_i64, non_blocking=True)
        self.g_i32.copy_(self.h_i32, non_blocking=True)
        if self._copies_done is not None:
            self._copies_done.record()
        if device_ids is not None:
            self.g_ids[:n].copy_(device_ids)
        if self.graph_times is None:
            return self.graphs[b]()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.graphs[b]()
        end.record()
        self.graph_times.append((b, start, end))
        return out


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables [num_seqs, widest] int32, rows padded with 0 (entries past a sequence's length are never read)."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return torch.from_numpy(out)


class _Replay:
    """A captured decode step: replaying it refreshes `out` in place."""

    def __init__(self, graph, out):
        self.graph, self.out = graph, out

    def __call__(self):
        self.graph.replay()
        return self.out
