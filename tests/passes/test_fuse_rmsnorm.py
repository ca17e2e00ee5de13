import numpy as np
import pytest

from kiln.passes import fuse_rmsnorm

from .util import check_pass, helper, model, ops, rand


def test_exported_rmsnorm_chain_becomes_one_layer():
    m = model([
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["xn", "g"], ["y"]),
    ], [("x", [2, 3, 16])], [("y", [2, 3, 16])],
        {"two": np.float32(2), "axes": np.array([-1], np.int64), "eps": np.float32(1e-6), "g": rand(16, seed=3)},
        opset=18)
    _, after = check_pass(fuse_rmsnorm, m, {"x": rand(2, 3, 16)}, atol=1e-5)
    assert ops(after) == ["kiln::RMSNorm"] and len(after.nodes[0].sources) == 7
    assert after.nodes[0].inputs == ["x", "g"]


def _rmsnorm_nodes(x, y, tag):
    return [helper.make_node("Pow", [x, "two"], [f"sq{tag}"]),
            helper.make_node("ReduceMean", [f"sq{tag}", "axes"], [f"ms{tag}"], keepdims=1),
            helper.make_node("Add", [f"ms{tag}", "eps"], [f"mse{tag}"]),
            helper.make_node("Sqrt", [f"mse{tag}"], [f"rms{tag}"]),
            helper.make_node("Reciprocal", [f"rms{tag}"], [f"inv{tag}"]),
            helper.make_node("Mul", [x, f"inv{tag}"], [f"xn{tag}"]),
            helper.make_node("Mul", [f"xn{tag}", "g"], [y])]


def test_residual_adds_join_the_norms_and_the_sum_read_by_the_next_residual_is_an_output():
    """A decoder's residual stream: h1 = x + d1 -> RMSNorm, h2 = h1 + d2 -> RMSNorm. The first fused norm writes
    h1 for the second add; the last writes no sum (nothing else reads it)."""
    m = model([helper.make_node("Add", ["x", "d1"], ["h1"]), *_rmsnorm_nodes("h1", "y1", 1),
               helper.make_node("Add", ["h1", "d2"], ["h2"]), *_rmsnorm_nodes("h2", "y2", 2)],
              [("x", [2, 3, 16]), ("d1", [2, 3, 16]), ("d2", [2, 3, 16])], [("y1", [2, 3, 16]), ("y2", [2, 3, 16])],
              {"two": np.float32(2), "axes": np.array([-1], np.int64), "eps": np.float32(1e-6),
               "g": rand(16, seed=3)}, opset=18)
    feeds = {"x": rand(2, 3, 16, seed=1), "d1": rand(2, 3, 16, seed=2), "d2": rand(2, 3, 16, seed=4)}
    _, after = check_pass(fuse_rmsnorm, m, feeds, atol=1e-5)
    assert ops(after) == ["kiln::RMSNorm", "kiln::RMSNorm"]
    assert [(n.inputs, n.outputs) for n in after.nodes] == [(["x", "g", "d1"], ["y1", "h1"]),
                                                            (["h1", "g", "d2"], ["y2", ""])]
    assert len(after.nodes[0].sources) == 8


def test_a_bias_add_before_the_norm_stays_apart():
    m = model([helper.make_node("Add", ["x", "b"], ["h"]), *_rmsnorm_nodes("h", "y", 1)],
              [("x", [2, 16])], [("y", [2, 16])],
              {"two": np.float32(2), "axes": np.array([-1], np.int64), "eps": np.float32(1e-6),
               "g": rand(16, seed=3), "b": rand(16, seed=5)}, opset=18)
    _, after = check_pass(fuse_rmsnorm, m, {"x": rand(2, 16)}, atol=1e-5)
    assert ops(after) == ["Add", "kiln::RMSNorm"]


def _fp16_engine_of_zoo_row(name):
    """(engine, rel L2 of its FP16 output against the FP32 module) for a zoo decoder row at its tiny size, CUDA."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from bench import zoo
    from bench.zoo_models import ZOO

    entry = next(e for e in ZOO if e.name == name)
    prep = zoo.prepare(entry, "tiny", 4)
    engine = zoo.build(prep, "fp16", "cuda", validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = list(engine.create_execution_context().run({k: v.cuda() for k, v in prep.feeds.items()}).values())
    return engine, zoo.rel_l2(outs, prep.reference)


@pytest.mark.gpu
def test_llama_fp16_engine_runs_residual_rmsnorms_and_merged_projections_on_the_gpu():
    """llama_lm (tiny): every norm after the first joins its residual add, q/k/v and gate/up are one GEMM each,
    and the FP16 engine stays within the zoo's FP16 tolerance of the FP32 model."""
    from bench import zoo

    engine, err = _fp16_engine_of_zoo_row("llama_lm")
    norms = [n for n in engine.graph.nodes if n.op_type == "RMSNorm"]
    joined = [n for n in norms if len(n.inputs) > 2 and n.inputs[2]]
    assert len(norms) == 5 and len(joined) == 4, [(n.inputs, n.tactic) for n in norms]
    assert sum(n.op_type == "Split" for n in engine.graph.nodes) == 4  # per layer: q/k/v, gate/up
    assert err <= zoo.TOLERANCE["fp16"], (err, [n.tactic for n in joined])
