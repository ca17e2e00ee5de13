"""nn.EmbeddingBag exported by torch.onnx (a Loop over the bags appending to a sequence) in an FP16 GPU engine:
the build unrolls the loop, turns the sequence into tensors and the per-bag sums into one reduction per table
(passes/inline_control_flow.py, passes/lower_sequences.py, passes/fuse_segment_reductions.py), so the engine
is a few tensor kernels and one CUDA graph. Skipped without CUDA."""

import pytest
import torch

import kiln
from bench.zoo_models import ZOO

pytestmark = pytest.mark.gpu

_SEQUENCE_OPS = {"Loop", "If", "SequenceEmpty", "SequenceInsert", "ConcatFromSequence"}


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("batch", [2, 32])
def test_embedding_bag_recommender_fp16_on_the_gpu_is_tensor_kernels_and_matches(batch):
    entry = next(e for e in ZOO if e.name == "embedding_bag_recommender")
    spec = entry.make("tiny", batch)
    module = spec.module.eval()
    with torch.no_grad():
        want = module(*spec.args)
    model, _ = kiln.from_torch(module, tuple(spec.args))
    names = [i.name for i in model.graph.input]
    engine = kiln.build(model, kiln.BuildConfig(device="cuda", fp16=True, progress=False,
                                                shapes={k: tuple(a.shape) for k, a in zip(names, spec.args)}))
    assert engine.capturable
    kinds = [n.op_type for n in engine.graph.nodes]
    assert not _SEQUENCE_OPS & set(kinds) and kinds.count("ReduceSum") == len(module.tables)
    ctx = engine.create_execution_context()
    feeds = {k: a.cuda() for k, a in zip(names, spec.args)}
    for _ in range(2):  # capture, then replay
        (got,) = ctx.run(feeds).values()
        assert got.is_cuda and got.dtype == torch.float32
        assert _rel_l2(got.cpu(), want) <= 2e-2
