"""LLMEngine and LLM: requests in, tokens and text out, in vLLM's shape.

`LLMEngine` holds the model runner, the block manager and the scheduler; each `step()` schedules one batch,
runs it, samples, detokenizes incrementally and applies the stop rules. With `tensor_parallel_size=N` the model
is split over N processes (tp_workers.py, parallel.py); the scheduler, the block manager and the sampler stay here
on rank 0. `LLM` wraps it for offline use
(`generate`, `stream`, `chat`).
"""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.errors import ConfigError, InputError, ModelError
from kiln.llm.config import ModelConfig
from kiln.llm.kv_cache import BlockManager
from kiln.llm.model import DecoderModel
from kiln.llm.parallel import Shard, check_tensor_parallel, shard_quantized
from kiln.llm.runner import ModelRunner, kv_cache_torch_dtype
from kiln.llm.sampling import SamplingParams
from kiln.llm.scheduler import ScheduledStep, Scheduler
from kiln.llm.sequence import Sequence, SequenceStatus
from kiln.llm.tokenizer import IncrementalDetokenizer, Tokenizer
from kiln.llm.tp_workers import Workers, init_group, rank_devices

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "load_model"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running, then "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    sent: list | None = None  # output_kind "delta": per sequence [tokens, text characters, finished] returned
    final_only: bool = False  # params.output_kind == "final_only": no output until every sequence finished


def load_model(path, progress: bool = False) -> tuple[dict, dict, Tokenizer, dict]:
    """(hf_config, tensors, tokenizer, extras) of an HF directory, a .gguf file or a .kiln LLM engine.

    extras carries what a built engine adds (e.g. "kv_cache_dtype", "kv_scales"). progress: a bar of the
    tensors read, drawn on stderr when it is a terminal."""
    p = Path(path)
    if p.suffix == ".gguf":
        from kiln.llm.gguf import load_gguf

        return (*load_gguf(p, progress), {})
    if p.suffix == ".kiln":
        try:
            from kiln.llm.engine_file import load_llm_engine
        except ImportError:
            raise ModelError(f"{p}: this Kiln build cannot read .kiln LLM engines (kiln.llm.engine_file).") from None
        return load_llm_engine(p, progress=progress)
    from kiln.llm.loader import load_hf_dir

    return (*load_hf_dir(p, progress), {})


def build_rank_model(cfg: ModelConfig, tensors: dict, dtype: torch.dtype, device: torch.device, shard: Shard,
                     quantization: str | None, quantized_weights: dict | None) -> DecoderModel:
    """This rank's DecoderModel: its shard of the weights, with a built engine's quantized matrices (cut to the
    shard) or the weights quantized at load."""
    from kiln.llm import quantize

    model = DecoderModel(cfg, tensors, dtype, device, shard=shard)
    if quantized_weights:  # a .kiln engine's stored matrices
        if shard.active:
            quantized_weights = {k: shard_quantized(cfg, k, q, model.layout) for k, q in quantized_weights.items()}
        quantize.install(model, quantized_weights)
    elif quantization not in (None, "none"):
        # Per output channel: a column-parallel shard's scales are the full matrix's; a row-parallel shard's are
        # those of its own columns.
        quantize.quantize_model(model, quantize.check_method(quantization))
    quantize.use_decode_gemv(model)  # float matrices and the LM head: the BF16 GEMV where it beats cuBLAS here
    return model


def kv_block_bytes(model: DecoderModel, kv_dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one KV block on this rank: K and V of block_size tokens in every layer."""
    cfg = model.cfg
    return 2 * cfg.num_layers * block_size * model.num_kv_heads * cfg.head_dim * kv_dtype.itemsize


def kv_memory_budget(model: DecoderModel, utilization: float, max_tokens: int, max_seqs: int) -> tuple[int, int, int]:
    """(bytes the KV pool may take, free, total) on this rank's CUDA device: utilization of its memory, less what
    is in use and the activations of the largest step, the logits of a full decode batch and the CUDA graphs'
    pools."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization = {utilization}: must be in (0, 1].")
    cfg = model.cfg
    # An engine closed earlier in this process may still hold its pool in a reference cycle or in torch's cache.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(model.device)
    act = max_tokens * (3 * cfg.hidden_size + 2 * cfg.intermediate_size + 2 * cfg.num_heads * cfg.head_dim) * 4
    reserve = act + max_seqs * cfg.vocab_size * 4 * 3 + (1 << 30)
    return int(total * utilization) - (total - free) - reserve, free, total


def kv_blocks_that_fit(model: DecoderModel, kv_dtype: torch.dtype, block_size: int, max_model_len: int,
                       utilization: float, max_tokens: int, max_seqs: int) -> int:
    """KV blocks for this rank's pool: on CUDA what free memory holds beside the weights and the activations."""
    if model.device.type != "cuda":
        return max(64, -(-max_model_len // 16) * 4)  # CPU: room for a few full-length sequences
    per_block = kv_block_bytes(model, kv_dtype, block_size)
    budget, free, total = kv_memory_budget(model, utilization, max_tokens, max_seqs)
    if budget < per_block:
        raise ConfigError(f"no GPU memory left for the KV cache on {model.device} (free {free / 2**30:.1f} GiB of "
                          f"{total / 2**30:.1f}); lower max_num_batched_tokens or raise gpu_memory_utilization.")
    # More blocks than every sequence at full length could never be used: a small model takes only what it can use.
    return min(budget // per_block, max_seqs * -(-max_model_len // block_size))


def _release(workers: Workers) -> None:
    workers.shutdown()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"device {device!r}: choose auto, cpu or cuda.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: no CUDA GPU is available here.")
    return torch.device(device)


class LLMEngine:
    def __init__(self, hf_config: dict, tensors: dict, tokenizer: Tokenizer, *, dtype=None,
                 kv_cache_dtype: str = "auto", device: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, block_size: int = 16, max_model_len: int | None = None,
                 num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = True, seed: int = 0, kv_scales=None, kv_calib=None,
                 quantization: str | None = None, quantized_weights: dict | None = None,
                 enforce_eager: bool = False, model_name: str = "model", tensor_parallel_size: int = 1,
                 source=None):
        """source: the path the weights came from (from_model); tensor-parallel workers load it themselves."""
        self.workers = None
        self.model_config = cfg = ModelConfig.from_hf(hf_config)
        self.tensor_parallel_size = tp = check_tensor_parallel(cfg, tensor_parallel_size)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = _pick_device(device)
        torch.manual_seed(seed)
        if dtype is None or dtype == "auto":
            torch_dtype = DTYPES[cfg.dtype] if self.device.type == "cuda" else torch.float32
        elif dtype in DTYPES:
            torch_dtype = DTYPES[dtype]
        else:
            raise ConfigError(f"dtype {dtype!r}: choose auto or one of {sorted(DTYPES)}.")
        for name, v, low in (("max_num_seqs", max_num_seqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                             ("block_size", block_size, 1)):
            if not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} = {v!r}: must be an integer >= {low}.")
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len = {self.max_model_len} exceeds the model's max_position_embeddings "
                              f"({cfg.max_position_embeddings}).")
        kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, torch_dtype)
        eight_bit = kv_dtype in (torch.float8_e4m3fn, torch.int8)
        if eight_bit and kv_scales is None and kv_calib is None:
            raise ConfigError(
                f"kv_cache_dtype {kv_cache_dtype!r} needs calibrated per-layer K/V scales: build an engine with "
                "`kiln llm build --kvCacheDtype ... --calib TEXT`, give kv_calib (a text file; --calib on the "
                "CLI) or pass kv_scales; Kiln never assumes a scale of 1.0.")
        if tp > 1 and eight_bit and kv_scales is None:
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} with tensor_parallel_size = {tp}: calibrating K/V "
                              "scales (kv_calib) runs on one process; build an engine with `kiln llm build "
                              "--kvCacheDtype ... --calib TEXT` (or pass kv_scales) and serve that.")
        devices = rank_devices(self.device, tp) if tp > 1 else [str(self.device)]
        self.device = torch.device(devices[0])
        if tp > 1:
            if self.device.type == "cuda":  # NCCL and the graph capture work on the current device
                torch.cuda.set_device(self.device)
            engine_weights = source is not None and Path(source).suffix == ".kiln" and bool(quantized_weights)
            spec = {"devices": devices, "dtype": str(torch_dtype).removeprefix("torch."),
                    "kv_dtype": str(kv_dtype).removeprefix("torch."), "quantization": quantization,
                    "kv_scales": kv_scales if eight_bit else None, "num_kv_blocks": num_kv_blocks,
                    "block_size": block_size, "max_model_len": self.max_model_len, "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens,
                    "gpu_memory_utilization": gpu_memory_utilization, "use_cuda_graphs": not enforce_eager,
                    "source": str(source) if source is not None else None, "engine_weights": engine_weights}
            if source is None:  # weights held in memory: the workers read them from a safetensors file
                spec["hf_config"] = hf_config
                self.workers = Workers(tp, spec, tensors, quantized_weights)
            else:
                self.workers = Workers(tp, spec)
            self._finalizer = weakref.finalize(self, _release, self.workers)
        try:
            self._init_rank0(cfg, tensors, tokenizer, torch_dtype, kv_dtype, eight_bit, kv_scales, kv_calib,
                             quantization, quantized_weights, num_kv_blocks, block_size, gpu_memory_utilization,
                             max_num_batched_tokens, max_num_seqs, enable_prefix_caching, enforce_eager)
        except BaseException:
            self.shutdown()
            raise
        self.requests: dict[str, _Request] = {}
        # Queue step N+1 on the device before step N's text and outputs are made (see step()); False runs the
        # steps one after the other.
        self.overlap_steps = True
        # Decode steps of plain-greedy batches also queued before the previous step's tokens reach the host, fed
        # its argmax on the device (see _launch_fed): the GPU does not wait for the host between decode steps.
        self.async_decode = False
        self._inflight = None  # (ScheduledStep, runner.LaunchedStep) queued and not yet collected
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def _init_rank0(self, cfg, tensors, tokenizer, torch_dtype, kv_dtype, eight_bit, kv_scales, kv_calib,
                    quantization, quantized_weights, num_kv_blocks, block_size, gpu_memory_utilization,
                    max_num_batched_tokens, max_num_seqs, enable_prefix_caching, enforce_eager) -> None:
        tp = self.tensor_parallel_size
        self.model = build_rank_model(cfg, tensors, torch_dtype, self.device, Shard(0, tp), quantization,
                                      quantized_weights)
        if not eight_bit:
            kv_scales = None
        elif kv_scales is None:
            from kiln.llm.calibrate import calibrate_kv_scales
            from kiln.llm.perplexity import read_text_tokens

            kv_scales = calibrate_kv_scales(self.model, read_text_tokens(tokenizer, kv_calib, 2048), kv_dtype,
                                            centre_keys=True)
        if eight_bit and len(kv_scales) != cfg.num_layers:
            raise ConfigError(f"kv_scales has {len(kv_scales)} entries; the model has {cfg.num_layers} layers.")
        self.kv_scales = kv_scales
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_that_fit(self.model, kv_dtype, block_size, self.max_model_len,
                                               gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        if self.workers is not None:  # every rank's KV pool has the same blocks: the fewest any rank fits
            fits = [m["kv_blocks"] for m in self.workers.wait("loaded")]
            num_kv_blocks = min([num_kv_blocks] + [f for f in fits if f is not None])
        if num_kv_blocks * block_size < self.max_model_len:
            raise ConfigError(f"num_kv_blocks = {num_kv_blocks} holds {num_kv_blocks * block_size} tokens, fewer than "
                              f"max_model_len = {self.max_model_len}: raise it or lower max_model_len.")
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        if self.workers is not None:
            self.workers.start(num_kv_blocks)
            init_group(0, tp, self.workers.init_method, str(self.device))
        self.runner = ModelRunner(self.model, num_blocks=num_kv_blocks, block_size=block_size, kv_dtype=kv_dtype,
                                  kv_scales=kv_scales, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                  use_cuda_graphs=not enforce_eager)
        if self.workers is not None:
            self.workers.wait("ready")
            self.runner.on_step = self.workers.send_step
        self.kv_cache_dtype = kv_dtype

    def shutdown(self) -> None:
        """Stops and reaps the tensor-parallel workers and leaves the process group (a no-op on one rank); the
        engine cannot step afterwards. Also done when the engine is garbage-collected or the interpreter exits."""
        if self.workers is not None:
            self._finalizer()

    @classmethod
    def from_model(cls, model, progress: bool = True, **kwargs) -> "LLMEngine":
        """progress: a bar of the weights loading on stderr, drawn only when it is a terminal (as vLLM's)."""
        hf_config, tensors, tokenizer, extras = load_model(model, progress)
        # What a built engine fixed (KV dtype and scales, quantized matrices, its limits, its tensor-parallel
        # size) are the defaults.
        for key in ("kv_cache_dtype", "kv_scales", "quantized_weights", "max_model_len", "max_num_seqs",
                    "tensor_parallel_size"):
            if extras.get(key) is not None and kwargs.get(key) in (None, "auto"):
                kwargs[key] = extras[key]
        if kwargs.get("kv_cache_dtype") not in (None, "auto", extras.get("kv_cache_dtype")):
            kwargs.pop("kv_scales", None)  # the engine's scales are for its own cache dtype
        kwargs.setdefault("model_name", Path(model).name)
        kwargs.setdefault("source", model)
        return cls(hf_config, tensors, tokenizer, **kwargs)

    # ----------------------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("prompt is empty.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise InputError("prompt_token_ids is empty.")
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InputError(f"prompt_token_ids holds {bad[0]}, outside the vocabulary "
                                 f"(0..{self.model_config.vocab_size - 1}).")
            return None, list(prompt)
        raise InputError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}.")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}.")
        if request_id in self.requests:
            raise InputError(f"request_id {request_id!r} is already running.")
        text, ids = self._prompt_ids(prompt)
        if len(ids) > self.max_model_len - 1:
            raise InputError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             f"(max_model_len), so at most {self.max_model_len - 1} fit with one generated token.")
        req = _Request(request_id, text, ids, params, final_only=params.output_kind == "final_only")
        eos = frozenset(self.tokenizer.eos_token_ids)
        parent = None
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if params.detokenize \
                else None
            seq = Sequence(request_id, i, ids, params, parent=parent, eos_token_ids=eos, detokenizer=detok,
                           arrival_time=arrival_time)
            parent = parent or seq
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        self.prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step and returns the outputs of the requests that produced a token (or finished).

        With overlap_steps (the default), the next step is scheduled and queued on the device as soon as this
        step's tokens are appended and its stop rules applied, before this step's text is detokenized and its
        outputs are built, so that host work runs while the GPU computes. Sequences that finished or were
        aborted before their step completed are dropped from it."""
        if self._inflight is None:
            self._inflight = self._launch(self.scheduler.schedule())
            if self._inflight is None:
                return []
        (step, launched), self._inflight = self._inflight, None
        fed = self._launch_fed(step, launched) if self.async_decode else None
        try:
            seqs, tokens, logprobs = self.runner.collect(launched)
        except Exception:
            self._step_failed()
            raise
        bm = self.block_manager
        bs, hashing = bm.block_size, bm.enable_prefix_caching
        for seq, n in zip(step.seqs, step.num_new_tokens):
            if seq.status is not SequenceStatus.FINISHED:
                seq.num_computed_tokens += n
                if hashing and seq.num_computed_tokens // bs > seq.num_hashed_blocks:  # a block became full
                    bm.mark_computed(seq)
        now = time.perf_counter()
        requests, touched, text_later = self.requests, {}, []
        finished = SequenceStatus.FINISHED
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            if seq.status is finished:  # aborted while its step ran
                continue
            self._append_token(seq, tok, lp, now, text_later)
            req = requests[seq.request_id]
            if not req.final_only or seq.status is finished:
                touched[seq.request_id] = req
        if fed is not None:
            self._inflight = fed
        elif self.overlap_steps:
            self._inflight = self._launch(self.scheduler.schedule())
        for seq, tok, flush in text_later:
            if tok is not None:
                seq.detokenizer.add(tok)
            if flush:
                seq.detokenizer.flush()
        outputs = []
        for req in touched.values():
            if req.final_only and not all(s.status is finished for s in req.seqs):
                continue
            out = self._output(req)
            if out.finished:
                del requests[req.request_id]
            outputs.append(out)
        return outputs

    def _launch(self, step):
        """(step, runner.LaunchedStep) of a scheduled step queued on the device; None for an empty step."""
        if not step.seqs:
            return None
        try:
            return step, self.runner.launch(step)
        except Exception:
            self._step_failed()
            raise

    def _launch_fed(self, step, launched):
        """async_decode: (the next decode step, its LaunchedStep) queued before `launched`'s tokens reach the
        host, its input ids `launched`'s argmax taken on the device; None where that does not apply (a step
        that is not all plain-greedy decode rows of the whole running batch, requests waiting to be admitted,
        tensor parallelism, no graph bucket, too few KV blocks). A sequence that ends at `launched` by its
        length is left out; one that ends by a stop token or string runs one row too many, dropped at collect."""
        sched, runner = self.scheduler, self.runner
        seqs = step.seqs
        if (launched.device_tokens is None or sched.waiting or not step.is_decode_only
                or len(seqs) != len(sched.running) or seqs != sched.running):
            return None
        rows, keep = [], []
        for i, seq in enumerate(seqs):
            n = len(seq.token_ids) + 1  # with the token in flight
            if n - seq.prompt_len < seq.params.max_tokens and n < self.max_model_len:
                rows.append(i)
                keep.append(seq)
        if not keep or not runner.can_feed(len(keep)):
            return None
        bm = self.block_manager
        for seq in keep:  # the next token's slot: one past the one in flight
            if not bm.reserve(seq, seq.num_computed_tokens + 2):
                return None
        nxt = ScheduledStep(keep, [1] * len(keep))
        try:
            return nxt, runner.launch_fed(nxt, launched, rows)
        except Exception:
            self._step_failed()
            raise

    def _step_failed(self) -> None:
        self._inflight = None
        self._fail_all()
        if self.workers is not None:  # the ranks are out of step now: raise a worker's error, stop them all
            try:
                self.workers.raise_failure()
            finally:
                self.shutdown()

    def _fail_all(self) -> None:
        """A step raised: return every block so nothing leaks, and drop the requests."""
        for rid in list(self.requests):
            self.abort_request(rid)

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float, text_later: list) -> None:
        """Appends a sampled token and applies the stop rules. The text is made at once only where a stop string
        needs it; otherwise (seq, token or None, flush) goes to text_later, for the detokenizer after the next
        step is launched (nothing for a sequence without one: SamplingParams.detokenize False)."""
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        p = seq.params
        n_out = len(seq.token_ids) - seq.prompt_len
        is_eos = token in seq.eos_token_ids and not p.ignore_eos
        special_stop = (is_eos or (p.stop_token_ids is not None and token in p.stop_token_ids)) \
            and n_out >= p.min_tokens
        shown = None if special_stop and p.skip_special_tokens and self.tokenizer.is_special(token) else token
        if special_stop:
            self._finish(seq, "stop", token, now)
            if seq.detokenizer is not None:
                text_later.append((seq, shown, True))
            return
        if p.stop and n_out >= p.min_tokens:
            detok = seq.detokenizer
            before = len(detok.text)
            detok.add(token)
            text = detok.text
            # Only the new text (plus the longest stop string's reach back) can hold a fresh match.
            start = max(0, before - max(len(s) for s in p.stop) + 1)
            hits = [(text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                detok.text = text[:i + len(s)] if p.include_stop_str_in_output else text[:i]
                self._finish(seq, "stop", s, now)  # the text is cut where it matched: no flush
            elif n_out >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
                self._finish(seq, "length", None, now)
                detok.flush()
            return
        if n_out >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length", None, now)
            if seq.detokenizer is not None:
                text_later.append((seq, token, True))
        elif seq.detokenizer is not None:
            text_later.append((seq, token, False))

    def _finish(self, seq: Sequence, reason: str, stop_reason, now: float) -> None:
        seq.finish_time = now
        self.scheduler.finish(seq, reason, stop_reason)

    def _output(self, req: _Request) -> RequestOutput:
        seqs = req.seqs
        delta = req.params.output_kind == "delta"
        if delta:
            outs = self._new_since_last(req)
        else:
            outs = [CompletionOutput(s.index, s.detokenizer.text if s.detokenizer is not None else "",
                                     s.token_ids[s.prompt_len:], s.finish_reason, s.stop_reason,
                                     list(s.logprobs) if s.logprobs is not None else None,
                                     s.cumulative_logprob if s.logprobs is not None else None) for s in seqs]
        first_seq = seqs[0]
        if len(seqs) == 1:
            done = first_seq.status == SequenceStatus.FINISHED
            if delta and not done:  # a stream's metrics come with its last output
                return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, False)
            first, finish = first_seq.first_token_time, first_seq.finish_time if done else None
        else:
            times = [s.first_token_time for s in seqs if s.first_token_time is not None]
            done = all(s.is_finished for s in seqs)
            first = min(times) if times else None
            finish = max(s.finish_time or 0 for s in seqs) if done else None
        metrics = RequestMetrics(first_seq.arrival_time, first, finish, sum(s.num_preemptions for s in seqs))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, done, metrics)

    @staticmethod
    def _new_since_last(req: _Request) -> list[CompletionOutput]:
        """output_kind "delta": each sequence's tokens, text and logprobs since the request's last output; a
        sequence with nothing new is left out unless it just finished. No copy of what was returned before, and
        (with one sequence) the metrics only in the last output: a stream's step costs two small objects."""
        if req.sent is None:
            req.sent = [[0, 0, False] for _ in req.seqs]
        outs = []
        for s, mark in zip(req.seqs, req.sent):
            text = s.detokenizer.text if s.detokenizer is not None else ""
            n, done = len(s.token_ids) - s.prompt_len, s.finish_reason is not None
            if n == mark[0] and len(text) <= mark[1] and done == mark[2]:
                continue
            outs.append(CompletionOutput(s.index, text[mark[1]:], s.token_ids[s.prompt_len + mark[0]:],
                                         s.finish_reason, s.stop_reason,
                                         s.logprobs[mark[0]:] if s.logprobs is not None else None,
                                         s.cumulative_logprob if s.logprobs is not None else None))
            mark[0], mark[1], mark[2] = n, max(len(text), mark[1]), done
        return outs

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks, "kv_blocks_free": bm.num_free_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
            "prompt_tokens_total": self.prompt_tokens_total, "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
        }


class LLM:
    """Offline generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model, **kwargs):
        self.llm_engine = LLMEngine.from_model(model, **kwargs)
        self._next_id = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel workers (see LLMEngine.shutdown)."""
        self.llm_engine.shutdown()

    def _new_id(self) -> str:
        self._next_id += 1
        return f"llm-{self._next_id}"

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in prompt order. prompts: a string, a list of strings, or a list of token-id lists.
        use_tqdm (vLLM's name): a bar of finished requests and the output rate on stderr, drawn only when stderr
        is a terminal; False draws nothing."""
        from kiln.progress import terminal_progress

        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InputError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts.")
        eng = self.llm_engine
        ids = []
        # generate returns finished outputs only, so none is built per step; the key keeps its params alive.
        final: dict[int, tuple[SamplingParams, SamplingParams]] = {}
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self._new_id())
                p = p or SamplingParams()
                if id(p) not in final:
                    final[id(p)] = (p, dataclasses.replace(p, output_kind="final_only"))
                eng.add_request(ids[-1], prompt, final[id(p)][1])
            done: dict[str, RequestOutput] = {}
            start, generated = time.perf_counter(), 0
            with terminal_progress("generate", len(ids), "requests", enabled=use_tqdm) as bar:
                while len(done) < len(ids):
                    for out in eng.step():
                        if out.finished:
                            done[out.request_id] = out
                            generated += sum(len(c.token_ids) for c in out.outputs)
                            rate = generated / max(time.perf_counter() - start, 1e-9)
                            bar.advance(f"requests, {generated} tokens out ({rate:.1f} tok/s)")
        except BaseException:
            for rid in ids:
                eng.abort_request(rid)
            raise
        return [done[r] for r in ids]

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yields RequestOutput (cumulative text and tokens) each time the request produces a token."""
        eng = self.llm_engine
        rid = self._new_id()
        eng.add_request(rid, prompt, params or SamplingParams())
        try:
            while True:
                for out in eng.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            eng.abort_request(rid)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], params)[0]
