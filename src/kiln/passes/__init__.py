"""The graph rewrites, in the order they run (builder/pipeline.py runs them between the build's first and last
steps, in its one list of passes).

Each pass is one module with `run(graph) -> None` (it rewrites the graph in
place) and one test: graph before/after, numerics unchanged. Fused layers are
nodes of the "kiln" domain (src/kiln/ops/fused.py) that remember their source
nodes; a fusion that was expected but could not fire is recorded in
graph.findings with the reason, for the inspector.
"""

from . import (
    attention_mask_rows,
    dead_code,
    fold_batchnorm,
    fold_constants,
    fold_dequantized_weights,
    fuse_attention,
    fuse_conv,
    fuse_elementwise,
    fuse_gemm,
    fuse_gemm_skip_layernorm,
    fuse_int4_weights,
    fuse_pooled_gemm,
    fuse_qdq,
    fuse_rmsnorm,
    fuse_rotary,
    fuse_segment_reductions,
    fuse_skip_layernorm,
    fuse_view_chains,
    gather_as_slice,
    gather_nd_host_index,
    gather_window_rows,
    inline_control_flow,
    insert_qdq,
    lower_sequences,
    merge_heads_as_view,
    merge_parallel_gemms,
    pad_gemm_columns,
    remove_noops,
    split_heads_as_view,
    stem_patches,
)

PIPELINE = [
    fold_constants,  # Constant nodes and constant-only subgraphs become weights (int8 weights stay int8)
    inline_control_flow,  # If on a constant -> its branch; Loop with a count the build knows -> its body, unrolled
    lower_sequences,  # sequences of known elements -> tensors (ConcatFromSequence -> Concat, SequenceAt -> element)
    remove_noops,  # Identity, inference Dropout, Transpose pairs that cancel
    fuse_segment_reductions,  # Concat of reductions over consecutive equal slices (embedding bags) -> one reduction
    dead_code,  # nodes nothing reads, weights nothing uses
    gather_as_slice,  # Gather of one constant index -> Slice (+ Squeeze): a view, not a copy
    gather_nd_host_index,  # GatherND on shape-arithmetic indices: offsets once per shape on the host
    gather_window_rows,  # rolls and window partitions of whole rows (Swin) -> one row gather, index on the host
    split_heads_as_view,  # sequence-first head split (merge batch*heads, split again) -> a view
    fold_batchnorm,  # BatchNorm scaled into the Conv/Gemm weights before it
    stem_patches,  # INT8/FP8 builds: a stride-2 RGB stem -> patches + a stride-1 convolution over 64 channels
    insert_qdq,  # INT8 builds: calibrated Q/DQ around GEMMs and convolutions (post-training quantization)
    fuse_int4_weights,  # MatMul on INT4 weights (group scales) -> weight-only INT4 GEMM
    fuse_qdq,  # Q/DQ around MatMul/Gemm/Conv -> INT8/FP8 layers (explicit quantization)
    fold_dequantized_weights,  # integer weights of layers left in float -> float weights
    fuse_conv,  # Conv + bias + residual Add + activation
    fuse_gemm,  # MatMul/Gemm + bias + activation (incl. GELU as exporters write it)
    fuse_pooled_gemm,  # global average pool + flatten + classifier GEMM -> one layer (a CNN's head)
    merge_parallel_gemms,  # Q, K, V projections reading one input -> one GEMM + Split
    pad_gemm_columns,  # a wide GEMM of unaligned width (an LM head) on zero-padded weights, then a Slice (a view)
    fuse_rotary,  # q * cos + rotate_half(q) * sin (HF Llama/Qwen2/Mistral RoPE) -> one layer
    fuse_attention,  # softmax(QK^T * s + mask) V -> one attention layer
    attention_mask_rows,  # a mask And-ed with all-True only to widen it over the queries keeps its row shape
    merge_heads_as_view,  # sequence-first head merge after attention, batch-major: no copy
    fuse_skip_layernorm,  # residual Add + LayerNorm
    fuse_gemm_skip_layernorm,  # a GEMM feeding only that norm joins it (split-K with the norm summing the parts)
    fuse_rmsnorm,  # x / sqrt(mean(x^2) + eps) * gamma as exporters write it
    fuse_view_chains,  # Reshape/Transpose chains that would copy twice or more (MobileViT's unfold) -> one copy
    fuse_elementwise,  # remaining chains of elementwise ops -> one generated kernel
    dead_code,  # weights the rewrites replaced
]


# The passes that write standard ONNX operators only (the others write Kiln's own, domain "kiln"): a graph
# rewritten by these alone is one other runtimes run (quant/qdq_export.py exports the quantized graph so).
STANDARD_ONNX = {fold_constants, inline_control_flow, lower_sequences, remove_noops, fuse_segment_reductions, dead_code,
                 gather_as_slice, split_heads_as_view, fold_batchnorm, insert_qdq, fold_dequantized_weights}


def up_to(last, standard_onnx: bool = False) -> list:
    """PIPELINE's passes up to and including `last`; standard_onnx: only those in STANDARD_ONNX."""
    head = PIPELINE[:PIPELINE.index(last) + 1]
    return [p for p in head if p in STANDARD_ONNX or not standard_onnx]
