import copy

import numpy as np
import torch

from kiln.ir.from_onnx import model_to_graph
from kiln.passes import gather_window_rows

from .swin_block import exported
from .util import check_pass, helper, model, ops, rand, run


def test_swin_rolls_and_window_partitions_become_one_row_gather_each():
    module, x, onnx_model = exported()
    before = model_to_graph(onnx_model)
    after = copy.deepcopy(before)
    gather_window_rows.run(after)
    # each block: partition and merge, one gather each; the shifted one's take its rolls (two axes each) too
    gathers = [n for n in after.nodes if n.op_type == "Gather"]
    assert sorted(len(n.sources) for n in gathers) == [3, 3, 3 + 6, 3 + 6]
    # no Concat or Pad moves activations any more: those left compute the indices on the host
    moved = [n.op_type for n in after.nodes if n.op_type in ("Concat", "Pad") and ".rows." not in n.name]
    assert moved == []
    got, = run(after, {"x": x})
    want, = run(before, {"x": x})
    assert torch.equal(got, want)  # a gather moves the same values: exact
    with torch.no_grad():
        torch.testing.assert_close(got, module(x), atol=1e-5, rtol=1e-5)


def _chain(nodes, x_shape, out_shape, inits):
    i64 = {k: np.array(v, np.int64) for k, v in inits.items()}
    return model([helper.make_node("Reshape", ["x", "s0"], ["x0"])] + nodes, [("x", x_shape)], [("y", out_shape)],
                 {"s0": np.array(x_shape, np.int64), **i64})


def test_chains_that_only_view_or_that_split_the_last_axis_are_left_alone():
    # a head split read strided (Reshape -> Transpose, no copy), and a transpose of half rows (the last axis split)
    heads = _chain([helper.make_node("Reshape", ["x0", "h"], ["x1"]),
                    helper.make_node("Transpose", ["x1"], ["x2"], perm=[0, 2, 1, 3]),
                    helper.make_node("Relu", ["x2"], ["y"])], [2, 6, 8], [2, 2, 6, 4], {"h": [2, 6, 2, 4]})
    halves = _chain([helper.make_node("Reshape", ["x0", "p"], ["x1"]),
                     helper.make_node("Transpose", ["x1"], ["x2"], perm=[0, 2, 1, 3]),
                     helper.make_node("Reshape", ["x2", "m"], ["y"])], [1, 4, 6], [1, 8, 3],
                    {"p": [1, 4, 2, 3], "m": [1, 8, 3]})
    for m, shape in ((heads, (2, 6, 8)), (halves, (1, 4, 6))):
        _, after = check_pass(gather_window_rows, m, {"x": rand(*shape)})
        assert "Gather" not in ops(after)


def test_patch_merging_gathers_rows_then_views_them_wider():
    # Swin's patch merging: 2 x 2 neighbouring rows of C become one row of 4C; the last Reshape is a view of the rows
    m = _chain([helper.make_node("Reshape", ["x0", "p"], ["x1"]),
                helper.make_node("Transpose", ["x1"], ["x2"], perm=[0, 1, 3, 4, 2, 5]),
                helper.make_node("Reshape", ["x2", "m"], ["y"])], [1, 4, 4, 3], [1, 2, 2, 12],
               {"p": [1, 2, 2, 2, 2, 3], "m": [1, 2, 2, 12]})
    _, after = check_pass(gather_window_rows, m, {"x": rand(1, 4, 4, 3)}, atol=0)
    assert ops(after).count("Gather") == 1 and ops(after).count("Transpose") == 1  # the index's, on the host


def test_zero_pad_is_dropped_and_a_roll_of_rows_gathers_them():
    m = _chain([helper.make_node("Pad", ["x0", "zeros"], ["p"]),
                helper.make_node("Slice", ["p", "k", "end", "ax"], ["a"]),
                helper.make_node("Slice", ["p", "zero", "k", "ax"], ["b"]),
                helper.make_node("Concat", ["a", "b"], ["y"], axis=1)], [2, 5, 3], [2, 5, 3],
               {"zeros": [0] * 6, "k": [2], "end": [5], "zero": [0], "ax": [1]})
    _, after = check_pass(gather_window_rows, m, {"x": rand(2, 5, 3)}, atol=0)
    assert "Pad" not in ops(after) and ops(after).count("Gather") == 1 and ops(after).count("Concat") == 3  # shapes


def test_engine_computes_the_index_on_the_host_once_and_gathers_on_the_device():
    import kiln
    from kiln import BuildConfig, Profile

    module, x, onnx_model = exported()
    shape = tuple(x.shape)
    engine = kiln.build(onnx_model, BuildConfig(profiles=[Profile({"x": (shape, shape, shape)})], device="cpu",
                                                progress=False))
    placed = {n.name: n.placement for n in engine.graph.nodes}
    gathers = [n for n in engine.graph.nodes if n.op_type == "Gather"]
    assert len(gathers) == 4 and all(n.placement == "device" for n in gathers)
    assert all(p == "host" for name, p in placed.items() if ".rows." in name and not name.endswith(
        (".gather", ".reshape", ".table")))
    got = engine.create_execution_context().run({"x": x})
    with torch.no_grad():
        torch.testing.assert_close(next(iter(got.values())), module(x), atol=1e-4, rtol=1e-4)
