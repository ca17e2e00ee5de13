import numpy as np
import pytest

import kiln
from kiln.errors import ConfigError
from kiln.passes import fuse_view_chains

from .util import check_pass, helper, model, ops, rand


def _shape(name, dims):
    return {name: np.array(dims, dtype=np.int64)}


def _unfold_model(extra_reader=False):
    """MobileViT's unfold ([2, 8, 4, 4] -> 2x2 patches -> [8, 4, 8]), then a 1x1 convolution of the fold back."""
    nodes = [
        helper.make_node("Reshape", ["x", "s0"], ["a"]),
        helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["b", "s1"], ["c"]),
        helper.make_node("Transpose", ["c"], ["d"], perm=[0, 3, 2, 1]),
        helper.make_node("Reshape", ["d", "s2"], ["seq"]),
        helper.make_node("Relu", ["seq"], ["r"]),
        helper.make_node("Reshape", ["r", "s3"], ["e"]),
        helper.make_node("Transpose", ["e"], ["f"], perm=[0, 3, 2, 1]),
        helper.make_node("Reshape", ["f", "s0"], ["g"]),
        helper.make_node("Transpose", ["g"], ["h"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["h", "s1"], ["img"]),
        helper.make_node("Conv", ["img", "w"], ["y"]),
    ]
    outputs = [("y", [2, 8, 4, 4])]
    if extra_reader:  # a value inside the chain read elsewhere: the chain stops there
        nodes.append(helper.make_node("Relu", ["c"], ["c2"]))
        outputs.append(("c2", [2, 8, 4, 4]))
    inits = {**_shape("s0", [32, 2, 2, 2]), **_shape("s1", [2, 8, 4, 4]), **_shape("s2", [8, 4, -1]),
             **_shape("s3", [2, 4, 4, 8]), "w": rand(8, 8, 1, 1, seed=1)}
    return model(nodes, [("x", [2, 8, 4, 4])], outputs, inits)


def test_unfold_and_fold_become_one_layer_each():
    _, after = check_pass(fuse_view_chains, _unfold_model(), {"x": rand(2, 8, 4, 4)}, atol=0)
    assert ops(after) == ["kiln::ViewChain", "Relu", "kiln::ViewChain", "Conv"]
    unfold, _, fold, _ = after.nodes
    assert unfold.attr("steps") == ["R:32,2,2,2", "T:0,2,1,3", "R:2,8,4,4", "T:0,3,2,1", "R:8,4,-1"]
    assert not unfold.attr("channels_last", 0) and fold.attr("channels_last") == 1  # a convolution reads the fold
    assert unfold.outputs == ["seq"] and fold.inputs == ["r"] and fold.outputs == ["img"]


def test_a_value_read_elsewhere_ends_the_chain():
    _, after = check_pass(fuse_view_chains, _unfold_model(extra_reader=True), {"x": rand(2, 8, 4, 4)}, atol=0)
    # the unfold's first Reshape -> Transpose -> Reshape ends at c; what is left copies once at most
    assert ops(after)[:4] == ["Reshape", "Transpose", "Reshape", "Transpose"]
    assert ops(after).count("kiln::ViewChain") == 1


def test_a_head_split_alone_is_left_as_it_is():
    nodes = [helper.make_node("Reshape", ["x", "s"], ["a"]),
             helper.make_node("Transpose", ["a"], ["y"], perm=[0, 2, 1, 3])]
    m = model(nodes, [("x", [2, 5, 8])], [("y", [2, 2, 5, 4])], _shape("s", [2, 5, 2, 4]))
    _, after = check_pass(fuse_view_chains, m, {"x": rand(2, 5, 8)}, atol=0)
    assert ops(after) == ["Reshape", "Transpose"]


def test_skip_passes_leaves_it_out_of_a_build_and_refuses_a_pass_it_cannot_leave_out():
    m, x = _unfold_model(), rand(2, 8, 4, 4)
    cfg = dict(shapes={"x": (2, 8, 4, 4)}, device="cpu", progress=False)
    built = {skip: kiln.build(m, kiln.BuildConfig(skip_passes=skip, **cfg)) for skip in ((), ("fuse_view_chains",))}
    assert [n.op_type for n in built[()].graph.nodes] == ["ViewChain", "Relu", "ViewChain", "Conv"]
    assert "ViewChain" not in [n.op_type for n in built[("fuse_view_chains",)].graph.nodes]
    with_pass, without = (list(e.create_execution_context().run({"x": x}).values())[0] for e in built.values())
    np.testing.assert_array_equal(with_pass, without)
    with pytest.raises(ConfigError, match=r"--skipPasses: 'fold_constants' is not a pass the build can leave out; "
                       r"these can: .*fuse_view_chains"):
        kiln.build(m, kiln.BuildConfig(skip_passes=("fold_constants",), **cfg))
