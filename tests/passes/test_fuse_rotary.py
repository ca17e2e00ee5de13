import numpy as np
import pytest

from kiln.passes import fuse_rotary

from .util import check_pass, helper, model, ops, rand

BIG = np.iinfo(np.int64).max  # the exporter's "to the end" of x[..., d // 2:]


def _rope(x="q", commuted=False, end=BIG, axis=3, neg_second=False, shape=(1, 2, 4, 8)):
    """q * cos + rotate_half(q) * sin as HF Llama exports it (torch.onnx, static positions), q [1, 2, 4, 8]."""
    ints = {"zero": [0], "half": [shape[3] // 2], "end": [end], "axis": [axis], "one": [1]}
    hi = helper.make_node("Slice", [x, "half", "end", "axis", "one"], ["x2"])
    lo = helper.make_node("Slice", [x, "zero", "half", "axis", "one"], ["x1"])
    neg = helper.make_node("Neg", ["x2"], ["n"])
    cat = helper.make_node("Concat", ["x1", "n"] if neg_second else ["n", "x1"], ["rot"], axis=-1)
    mul_cos = helper.make_node("Mul", ["cos", x] if commuted else [x, "cos"], ["qc"])
    mul_sin = helper.make_node("Mul", ["sin", "rot"] if commuted else ["rot", "sin"], ["rs"])
    add = helper.make_node("Add", ["rs", "qc"] if commuted else ["qc", "rs"], ["y"])
    inits = {k: np.array(v, dtype=np.int64) for k, v in ints.items()}
    inits.update(cos=rand(1, 1, *shape[2:], seed=2), sin=rand(1, 1, *shape[2:], seed=3))
    return model([mul_cos, lo, hi, neg, cat, mul_sin, add], [(x, list(shape))], [("y", list(shape))], inits)


@pytest.mark.parametrize("commuted", [False, True])
def test_rotate_half_rope_becomes_one_layer(commuted):
    _, after = check_pass(fuse_rotary, _rope(commuted=commuted), {"q": rand(1, 2, 4, 8, seed=1)})
    assert ops(after) == ["kiln::Rotary"]
    node = after.nodes[0]
    assert node.inputs == ["q", "cos", "sin"] and node.outputs == ["y"]
    assert (node.attrs["split"], node.attrs["axis"], node.attrs["concat_axis"]) == (4, 3, -1)
    assert len(node.sources) == 7


def test_a_slice_ending_before_the_axis_end_keeps_its_bound():
    """x[..., 4:6] rotated: not rotate_half, but the layer computes what the nodes did (the kernel declines)."""
    m = _rope(end=6)
    m.graph.output[0].type.tensor_type.shape.dim[3].dim_value = 6
    m.graph.initializer[-2].CopyFrom(helper.make_tensor("cos", 1, [1, 1, 4, 6], rand(1, 1, 4, 6, seed=2).ravel()))
    m.graph.initializer[-1].CopyFrom(helper.make_tensor("sin", 1, [1, 1, 4, 6], rand(1, 1, 4, 6, seed=3).ravel()))
    _, after = check_pass(fuse_rotary, m, {"q": rand(1, 2, 4, 6, seed=1)})
    assert ops(after) == ["kiln::Rotary"] and after.nodes[0].attrs["end"] == 6


def test_the_negation_on_the_other_half_is_not_rope():
    _, after = check_pass(fuse_rotary, _rope(neg_second=True), {"q": rand(1, 2, 4, 8, seed=1)})
    assert "kiln::Rotary" not in ops(after)


def test_an_intermediate_read_elsewhere_blocks_the_fusion():
    m = _rope()
    m.graph.output.append(helper.make_tensor_value_info("rot", 1, [1, 2, 4, 8]))
    _, after = check_pass(fuse_rotary, m, {"q": rand(1, 2, 4, 8, seed=1)})
    assert "kiln::Rotary" not in ops(after)


def test_computed_angles_fuse_too():
    """cos/sin from position ids (a dynamic export): model inputs here, [batch, 1, seq, dim]."""
    m = _rope()
    del m.graph.initializer[-2:]
    m.graph.input.extend([helper.make_tensor_value_info(n, 1, [1, 1, 4, 8]) for n in ("cos", "sin")])
    feeds = {"q": rand(1, 2, 4, 8, seed=1), "cos": rand(1, 1, 4, 8, seed=2), "sin": rand(1, 1, 4, 8, seed=3)}
    _, after = check_pass(fuse_rotary, m, feeds)
    assert ops(after) == ["kiln::Rotary"] and after.nodes[0].inputs == ["q", "cos", "sin"]


@pytest.mark.gpu
def test_an_fp16_engine_runs_rope_on_the_triton_kernel():
    """Tactic selection on the GPU keeps the kernel (one pass) over the reference (five torch ops) at a size where
    the passes, not the launches, decide: 64 sequences of 8 heads x 128 positions x 64."""
    import torch

    import kiln

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shape = (64, 8, 128, 64)
    engine = kiln.build(_rope(shape=shape), kiln.BuildConfig(device="cuda", fp16=True, progress=False))
    (node,) = [n for n in engine.graph.nodes if n.op_type == "Rotary"]
    assert node.tactic == "triton_rotary"
    q = torch.as_tensor(rand(*shape, seed=1))
    want = engine.graph.initializers  # cos/sin as the engine stores them (FP16)
    cos, sin = (want[k].float() for k in ("cos", "sin"))
    ref = q * cos + torch.cat([-q[..., 32:], q[..., :32]], dim=-1) * sin
    got = engine.create_execution_context().run({"q": q.cuda()})["y"]
    torch.testing.assert_close(got.cpu().float(), ref, atol=1e-2, rtol=1e-2)
