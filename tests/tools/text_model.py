"""A tiny text classifier as a DistilBERT-like head would see it, written with onnx.helper (no export: fast).

input_ids [B, S] int64 -> embedding Gather (VOCAB rows) -> mean over the positions attention_mask [B, S]
keeps -> MatMul + ReLU -> MatMul -> logits [B, 2]. One hidden unit carries a large activation (an outlier
channel, as transformers have): per-tensor INT8 scales then leave the other units few levels, and the
logits, small as an untrained head's are, lose most of their precision.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, HIDDEN, CLASSES = 1000, 16, 2


def text_classifier(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    w1 = (rng.standard_normal((HIDDEN, HIDDEN)) / 4).astype(np.float32)
    w1[:, 0] = 0.0
    b1 = np.zeros(HIDDEN, np.float32)
    b1[0] = 60.0  # the outlier unit: always on, large
    w2 = (rng.standard_normal((HIDDEN, CLASSES)) * 0.02).astype(np.float32)
    w2[0] = 0.0  # the logits do not read the outlier
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((table, "embeddings.word_embeddings.weight"), (w1, "w1"), (b1, "b1"), (w2, "w2"),
              (np.zeros(CLASSES, np.float32), "b2"), (np.array([1], np.int64), "axis1"),
              (np.array([-1], np.int64), "last"))]
    nodes = [
        helper.make_node("Gather", ["embeddings.word_embeddings.weight", "input_ids"], ["emb"], name="embed"),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT, name="mask_cast"),
        helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"], name="mask_unsqueeze"),
        helper.make_node("Mul", ["emb", "mask3"], ["masked"], name="apply_mask"),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0, name="sum_tokens"),
        helper.make_node("ReduceSum", ["mask3", "axis1"], ["count"], keepdims=0, name="count_tokens"),
        helper.make_node("Div", ["summed", "count"], ["pooled"], name="mean"),
        helper.make_node("MatMul", ["pooled", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
        helper.make_node("Relu", ["h1"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w2"], ["l0"], name="classifier"),
        helper.make_node("Add", ["l0", "b2"], ["logits"], name="classifier_bias"),
    ]
    graph = helper.make_graph(
        nodes, "text_classifier",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def token_batch(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs as a tokenizer writes them: ids over the vocabulary, masks with padding at the end."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (batch, seq), dtype=np.int64)
    lengths = rng.integers(seq // 2, seq + 1, batch)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}
