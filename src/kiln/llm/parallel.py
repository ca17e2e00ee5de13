"""Tensor parallelism of the decoder (Megatron-LM's split, as vLLM and TensorRT-LLM do it).

Each of N ranks holds one shard of every layer:
- column-parallel: q/k/v and gate/up keep the output rows of the rank's heads / its slice of the MLP width;
- row-parallel: o_proj and down_proj keep the matching input columns; their partial products are summed by an
  all-reduce (the only communication inside a layer, two per layer);
- vocabulary-parallel: the embedding and the LM head keep a contiguous slice of the (padded) vocabulary; the
  embedding looks up the ids it owns (zero rows elsewhere) and all-reduces, the LM head's logits are all-gathered.
KV heads are split like the query heads. With fewer KV heads than ranks they are replicated: each rank keeps the
one KV head its query heads read (N must then be a multiple of num_key_value_heads).

`Shard` says which rank a model is and carries its process group; `world_size == 1` is the plain model (no
collectives, nothing sliced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import ConfigError, UnsupportedError


@dataclass
class Shard:
    rank: int = 0
    world_size: int = 1
    group: object = None  # the torch.distributed process group (None: the default group)

    @property
    def active(self) -> bool:
        return self.world_size > 1


def check_tensor_parallel(cfg, size, source: str = "config.json") -> int:
    """Refuses a tensor-parallel size the model cannot be split by, naming the config key; returns the size."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size = {size!r}: must be an integer >= 1.")
    if size == 1:
        return 1
    if cfg.family == "gpt2":
        raise UnsupportedError(f"tensor_parallel_size = {size}: GPT-2 models ({source}) are not split across ranks "
                               "(their fused Conv1D layout); use tensor_parallel_size = 1.")
    if cfg.num_heads % size:
        raise ConfigError(f"tensor_parallel_size = {size} does not divide num_attention_heads = {cfg.num_heads} "
                          f"({source}): every rank needs the same number of query heads.")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(f"tensor_parallel_size = {size} and num_key_value_heads = {kv} ({source}): one must divide "
                          "the other (KV heads are split across ranks, or each replicated over size / kv ranks).")
    if cfg.intermediate_size % size:
        raise ConfigError(f"tensor_parallel_size = {size} does not divide intermediate_size = "
                          f"{cfg.intermediate_size} ({source}).")
    return size


@dataclass(frozen=True)
class ShardLayout:
    """Which heads, KV heads, MLP columns and vocabulary rows one rank holds."""

    rank: int
    world_size: int
    heads: tuple[int, int]  # query heads [start, end)
    kv_heads: tuple[int, int]  # KV heads [start, end)
    intermediate: tuple[int, int]  # MLP width [start, end)
    vocab: tuple[int, int]  # rows of the padded vocabulary [start, end)
    padded_vocab: int

    def to_json(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "query_heads": list(self.heads),
                "kv_heads": list(self.kv_heads), "intermediate": list(self.intermediate),
                "vocab_rows": list(self.vocab), "padded_vocab_size": self.padded_vocab}


def layout(cfg, rank: int, world_size: int) -> ShardLayout:
    n = world_size
    hl = cfg.num_heads // n
    h0 = rank * hl
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    kv0, kv1 = h0 // group, (h0 + hl - 1) // group + 1
    il = cfg.intermediate_size // n
    vp = -(-cfg.vocab_size // n)
    return ShardLayout(rank, n, (h0, h0 + hl), (kv0, kv1), (rank * il, rank * il + il), (rank * vp, rank * vp + vp),
                       vp * n)


def shard_manifest(cfg, world_size: int) -> dict:
    """What each rank of a `world_size`-way split holds (an engine file's 'tensor_parallel' entry)."""
    return {"world_size": world_size, "split": "q/k/v, gate/up column-parallel; o, down row-parallel (all-reduce); "
            "embedding and LM head vocabulary-parallel; KV heads by rank (replicated when fewer than ranks)",
            "shards": [layout(cfg, r, world_size).to_json() for r in range(world_size)]}


# --- which rows / columns of each matrix a rank keeps ---------------------------------------------------------


def matrix_rows(cfg, key: str, lay: ShardLayout) -> torch.Tensor | None:
    """Output rows of model.py's concatenated matrix `key` (qkv, gate_up) that the rank keeps; None: all."""
    hd = cfg.head_dim
    if key == "qkv":
        qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
        (h0, h1), (k0, k1) = lay.heads, lay.kv_heads
        return torch.cat([torch.arange(h0 * hd, h1 * hd), torch.arange(qd + k0 * hd, qd + k1 * hd),
                          torch.arange(qd + kvd + k0 * hd, qd + kvd + k1 * hd)])
    if key == "gate_up":
        i0, i1 = lay.intermediate
        return torch.cat([torch.arange(i0, i1), torch.arange(cfg.intermediate_size + i0, cfg.intermediate_size + i1)])
    return None


def matrix_cols(cfg, key: str, lay: ShardLayout) -> tuple[int, int] | None:
    """Input columns [start, end) of a row-parallel matrix (o, down) that the rank keeps; None: all."""
    if key == "o":
        return lay.heads[0] * cfg.head_dim, lay.heads[1] * cfg.head_dim
    if key == "down":
        return lay.intermediate
    return None


def shard_matrix(cfg, key: str, w: torch.Tensor, lay: ShardLayout) -> torch.Tensor:
    rows, cols = matrix_rows(cfg, key, lay), matrix_cols(cfg, key, lay)
    if rows is not None:
        w = w.index_select(0, rows.to(w.device))
    if cols is not None:
        w = w[:, cols[0]:cols[1]]
    return w.contiguous()


def shard_vocab(w: torch.Tensor, lay: ShardLayout) -> torch.Tensor:
    """Rows [v0, v1) of an embedding / LM head [vocab, hidden], zero rows past the real vocabulary."""
    v0, v1 = lay.vocab
    part = w[v0:min(v1, w.shape[0])]
    if part.shape[0] < v1 - v0:
        pad = torch.zeros((v1 - v0 - part.shape[0], w.shape[1]), dtype=w.dtype, device=w.device)
        part = torch.cat([part, pad])
    return part.contiguous()


def shard_quantized(cfg, key: str, q, lay: ShardLayout):
    """The rank's part of a stored QuantizedWeight (kiln.llm.quantize): its codes and per-row scales, and for the
    row-parallel matrices the input columns (INT4 groups of 128 must not straddle two ranks)."""
    from kiln.llm.quantize import INT4_GROUP, QuantizedWeight

    kind = key.split(".")[-1]
    rows, cols = matrix_rows(cfg, kind, lay), matrix_cols(cfg, kind, lay)
    codes, scale, zero, inp, in_features = q.codes, q.scale, q.zero, q.input_scale, q.in_features
    if rows is not None:
        r = rows.to(codes.device)
        codes, scale = codes.index_select(0, r), scale.index_select(0, r)
        zero = None if zero is None else zero.index_select(0, r)
    if cols is not None:
        c0, c1 = cols
        if q.method == "int4-awq":
            if c0 % INT4_GROUP or (c1 % INT4_GROUP and c1 != in_features):
                raise UnsupportedError(f"'{key}' is INT4 in groups of {INT4_GROUP} input columns; tensor-parallel "
                                       f"rank {lay.rank} of {lay.world_size} would start or end inside a group "
                                       f"(columns {c0}..{c1}). Use a tensor-parallel size that keeps groups whole.")
            g0, g1 = c0 // INT4_GROUP, -(-c1 // INT4_GROUP)
            codes = codes[:, g0 * INT4_GROUP // 2:g1 * INT4_GROUP // 2]
            scale, zero = scale[:, g0:g1], zero[:, g0:g1]
        else:
            codes = codes[:, c0:c1]
        inp = None if inp is None else inp[c0:c1]
        in_features = c1 - c0

    def c(t):
        return None if t is None else t.contiguous()

    return QuantizedWeight(c(codes), method=q.method, scale=c(scale), in_features=in_features, zero=c(zero),
                           input_scale=c(inp))


# --- collectives ---------------------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Sums x over the ranks, in place (a no-op on one rank). NCCL's all-reduce is captured by CUDA graphs."""
    if shard.active:
        import torch.distributed as dist

        dist.all_reduce(x, group=shard.group)
    return x


def all_gather_last(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[..., n] on each rank -> [..., world_size * n], the ranks' parts in rank order."""
    if not shard.active:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    if dist.get_backend(shard.group) == "nccl":  # one buffer: what a CUDA graph can capture
        out = torch.empty((shard.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=shard.group)
        parts = out.unbind(0)
    else:
        parts = [torch.empty_like(x) for _ in range(shard.world_size)]
        dist.all_gather(parts, x, group=shard.group)
    return torch.cat(parts, dim=-1)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, lay: ShardLayout, shard: Shard):
    """Rows of the full embedding for `ids`, from each rank's vocabulary slice: ids outside it look up zeros."""
    v0, v1 = lay.vocab
    mine = (ids >= v0) & (ids < v1)
    local = torch.where(mine, ids - v0, torch.zeros_like(ids))
    h = torch.nn.functional.embedding(local, weight) * mine[:, None].to(weight.dtype)
    return all_reduce(h, shard)
