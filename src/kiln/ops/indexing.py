"""Indexing ops: Gather/Scatter families, OneHot, TopK, NonZero, Compress, Unique...

ONNX allows negative indices (counted from the end) nearly everywhere; torch
does not, so every index tensor is normalized first.
"""

import math

import torch

from .registry import register

# torch has few kernels for uint16/32/64 (fewer on CUDA): data movement and wrap-around
# arithmetic run on a same-width signed view (same bits), ordering on a sign-flipped one.
_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def signed_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_SIGNED[t.dtype]) if t.dtype in _SIGNED else t


def order_key(t: torch.Tensor) -> torch.Tensor:
    """Values that compare like t's: unsigned ones as signed with the sign bit flipped."""
    if t.dtype not in _SIGNED:
        return t
    signed = _SIGNED[t.dtype]
    return t.view(signed) ^ torch.iinfo(signed).min


def from_order_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (key ^ torch.iinfo(key.dtype).min).view(dtype) if dtype in _SIGNED else key


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _wrap(index: torch.Tensor, dim) -> torch.Tensor:
    """int64 indices with negatives counted from the end of an axis of size `dim`."""
    index = index.to(torch.int64)
    if index.is_cuda and dim > 0:
        # One kernel, not three (BERT's embedding and mask gathers ran nine at batch 1). Indices outside
        # [-dim, dim) are an error in ONNX: on the CPU index_select reports them, on a GPU they would
        # fault the device gather, here they wrap instead.
        return index.remainder(dim)
    return torch.where(index < 0, index + dim, index)


# --- gathers ---------------------------------------------------------------------

@register("Gather")
def gather(node, x, indices):
    axis = _axis(node.attr("axis", 0), x.dim())
    idx = _wrap(indices, x.shape[axis])
    out = x.index_select(axis, idx.reshape(-1).to(x.device))
    return out.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])


@register("GatherElements", since=11)
def gather_elements(node, x, indices):
    axis = _axis(node.attr("axis", 0), x.dim())
    return torch.gather(x, axis, _wrap(indices, x.shape[axis]))


def _flat_positions(shape, indices: torch.Tensor) -> torch.Tensor:
    """Row-major offsets of the index tuples in indices' last axis within `shape`."""
    # Python-int arithmetic per axis: no host-to-device copy, so the layer can be in a CUDA graph.
    flat = None
    for i, dim in enumerate(shape):
        term = _wrap(indices[..., i], dim) * math.prod(shape[i + 1:])
        flat = term if flat is None else flat + term
    return flat if flat is not None else torch.zeros(indices.shape[:-1], dtype=torch.int64, device=indices.device)


@register("GatherND", since=11)
def gather_nd(node, x, indices):
    b = node.attr("batch_dims", 0)
    k = indices.shape[-1]
    batch = math.prod(x.shape[:b])
    # Rows of x addressed by the index tuples, per batch entry: (batch, positions, *rest).
    rest = x.shape[b + k:]
    rows = x.reshape(batch, math.prod(x.shape[b:b + k]), *rest)
    flat = _flat_positions(x.shape[b:b + k], indices.reshape(batch, -1, k))
    out = rows[torch.arange(batch, device=x.device)[:, None], flat]
    return out.reshape(*indices.shape[:-1], *rest)


# GatherND on index tuples that are shape arithmetic (host values: HF transformers' padding mask is a
# GatherND over arange-built indices) is split by kiln/passes/gather_nd_host_index.py: the offsets once per
# input shape on the host, then one gather kernel on the device instead of the offset arithmetic each run.
@register("GatherNDOffsets", domain="kiln")
def gather_nd_offsets(node, indices, data_shape):
    """Row-major offsets of GatherND's (batch_dims 0) index tuples within the data's leading axes."""
    dims = [int(d) for d in data_shape[:indices.shape[-1]]]
    for axis, dim in enumerate(dims):
        bad = (indices[..., axis] < -dim) | (indices[..., axis] >= dim)
        if bool(bad.any()):
            raise IndexError(f"GatherND index {int(indices[..., axis][bad][0])} is out of range for data axis "
                             f"{axis} of size {dim}.")
    return _flat_positions(dims, indices)


@register("GatherNDRows", domain="kiln", host_inputs=(2,))
def gather_nd_rows(node, x, offsets, indices):
    """GatherND (batch_dims 0) by precomputed offsets; `indices` (read on the host) gives the number of leading
    data axes the tuples address. Tuples that walk those axes in order (HF BERT's padding mask: (b, k) for every
    b and k) only reshape the data: a view, no gather kernel."""
    k = indices.shape[-1]
    rest = x.shape[k:]
    if _in_order(indices, x.shape[:k]):
        return x.reshape(*indices.shape[:-1], *rest)
    return x.reshape(-1, *rest).index_select(0, offsets.reshape(-1)).reshape(*offsets.shape, *rest)


def _in_order(indices: torch.Tensor, dims) -> bool:
    """Whether host index tuples address every row of `dims` once, in row-major order."""
    n = math.prod(int(d) for d in dims)
    if indices.device.type != "cpu" or indices[..., 0].numel() != n:
        return False
    flat = _flat_positions([int(d) for d in dims], indices.reshape(-1, indices.shape[-1]))
    return bool(torch.equal(flat, torch.arange(n, dtype=flat.dtype)))


# --- scatters --------------------------------------------------------------------

_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _check_reduction(node):
    r = node.attr("reduction", "none")
    if r != "none" and r not in _REDUCE:
        return f"{node.op_type} reduction '{r}' is not supported (Kiln supports none, {', '.join(_REDUCE)})"
    return None


def _scatter(x, axis, index, updates, reduction):
    dtype = x.dtype
    if reduction in ("max", "min"):
        x, updates = order_key(x), order_key(updates)
    else:  # assignment, add and mul give the same bits on a signed view
        x, updates = signed_view(x), signed_view(updates)
    if reduction == "none":
        out = torch.scatter(x, axis, index, updates)
    else:
        out = torch.scatter_reduce(x, axis, index, updates, _REDUCE[reduction], include_self=True)
    return from_order_key(out, dtype) if reduction in ("max", "min") else out.view(dtype)


@register("ScatterElements", since=11, check=_check_reduction)
def scatter_elements(node, x, indices, updates):
    axis = _axis(node.attr("axis", 0), x.dim())
    return _scatter(x, axis, _wrap(indices, x.shape[axis]), updates, node.attr("reduction", "none"))


@register("Scatter", since=9)
def scatter(node, x, indices, updates):
    axis = _axis(node.attr("axis", 0), x.dim())
    return _scatter(x, axis, _wrap(indices, x.shape[axis]), updates, "none")


@register("ScatterND", since=11, check=_check_reduction)
def scatter_nd(node, x, indices, updates):
    k = indices.shape[-1]
    rest = x.shape[k:]
    rows = x.reshape(math.prod(x.shape[:k]), math.prod(rest))
    flat = _flat_positions(x.shape[:k], indices.reshape(-1, k))
    # Scatter whole rows along axis 0 (torch.scatter works for every dtype; index_put does not).
    src = updates.reshape(flat.numel(), rows.shape[1])
    index = flat[:, None].expand(src.shape)
    return _scatter(rows, 0, index, src, node.attr("reduction", "none")).reshape(x.shape)


def _check_tensor_scatter(node):
    mode = node.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        return f"TensorScatter mode '{mode}' is not one of linear, circular"
    return None


@register("TensorScatter", check=_check_tensor_scatter, since=24)
def tensor_scatter(node, past, update, write_indices=None):
    """A KV-cache write: update's positions along `axis` land at write_indices[b] onwards in batch b's rows."""
    axis = _axis(node.attr("axis", -2), past.dim())
    if axis == 0:
        raise ValueError("TensorScatter axis must not be the batch axis 0")
    batch, length, cache_len = past.shape[0], update.shape[axis], past.shape[axis]
    start = (torch.zeros(batch, dtype=torch.int64, device=past.device) if write_indices is None
             else write_indices.to(torch.int64))
    pos = start[:, None] + torch.arange(length, device=past.device)  # (batch, length)
    if node.attr("mode", "linear") == "circular":
        pos = pos % cache_len
    index = pos.reshape((batch,) + (1,) * (axis - 1) + (length,) + (1,) * (past.dim() - axis - 1))
    return _scatter(past, axis, index.expand(update.shape), update, "none")


# --- one-hot, top-k, sequences -----------------------------------------------------

# Float indices keep their exact values (an FP16 layer would round them).
@register("OneHot", host_inputs=(1,), keeps_input_types=True, since=9)
def one_hot(node, indices, depth, values):
    depth = int(depth.item())
    idx = indices.to(torch.int64)
    idx = torch.where(idx < 0, idx + depth, idx)  # out-of-range indices give an all-"off" row
    axis = _axis(node.attr("axis", -1), indices.dim() + 1)
    classes = torch.arange(depth, device=idx.device).reshape([depth] + [1] * (indices.dim() - axis))
    hot = idx.unsqueeze(axis) == classes
    return torch.where(hot, values[1], values[0])


@register("TopK", host_inputs=(1,))
def top_k(node, x, k=None):
    k = int(k.item()) if node.opset >= 10 else node.attr("k")
    axis = _axis(node.attr("axis", -1), x.dim())
    largest = bool(node.attr("largest", 1))
    # A stable sort keeps equal values in index order, as ONNX requires (torch.topk does not).
    _, order = torch.sort(order_key(x), dim=axis, descending=largest, stable=True)
    order = order.narrow(axis, 0, k)
    return torch.gather(signed_view(x), axis, order).view(x.dtype), order


@register("ReverseSequence", since=10)
def reverse_sequence(node, x, lengths):
    b_axis, t_axis = node.attr("batch_axis", 1), node.attr("time_axis", 0)
    t = torch.arange(x.shape[t_axis], device=x.device)
    lens = lengths.to(torch.int64).to(x.device)
    shape = [1] * x.dim()
    shape[t_axis], shape[b_axis] = -1, 1
    t = t.reshape(shape)
    shape[t_axis], shape[b_axis] = 1, -1
    lens = lens.reshape(shape)
    # Within each sequence's length, time step i reads from length-1-i.
    src = torch.where(t < lens, lens - 1 - t, t)
    return torch.gather(x, t_axis, src.expand(x.shape))


# --- value-dependent output shapes ---------------------------------------------------

@register("NonZero", data_dependent=True, since=9)
def non_zero(node, x):
    return torch.nonzero(signed_view(x) != 0).T.contiguous()


@register("Compress", data_dependent=True, since=9)
def compress(node, x, condition):
    axis = node.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = _axis(axis, x.dim())
    # A condition shorter than the axis selects among the leading elements only.
    keep = torch.nonzero(condition[: x.shape[axis]]).reshape(-1)
    return x.index_select(axis, keep.to(x.device))


@register("Unique", data_dependent=True, since=11)
def unique(node, x):
    axis = node.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = _axis(axis, x.dim())
    y, inverse, counts = torch.unique(order_key(x), sorted=True, return_inverse=True, return_counts=True, dim=axis)
    y = from_order_key(y, x.dtype)
    n = x.shape[axis]
    first = torch.full((y.shape[axis],), n, dtype=torch.int64, device=x.device)
    first = first.scatter_reduce(0, inverse, torch.arange(n, device=x.device), "amin")
    if not node.attr("sorted", 1):
        # Unsorted: unique values in order of first occurrence.
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=x.device)
        y, first, counts, inverse = y.index_select(axis, order), first[order], counts[order], rank[inverse]
    return y, first, inverse, counts
