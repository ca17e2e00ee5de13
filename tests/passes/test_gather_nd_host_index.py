import numpy as np
import pytest
import torch

from kiln.engine.interpreter import execute
from kiln.errors import KilnError
from kiln.ir.from_onnx import model_to_graph
from kiln.passes import gather_nd_host_index

from .util import check_pass, helper, model, ops, rand


def _gather_nd(indices=None):
    """y = GatherND(x, idx): constant (host-known) index tuples, or idx as a graph input when None."""
    nodes = [helper.make_node("GatherND", ["x", "idx"], ["y"], name="mask_gather")]
    inputs = [("x", [3, 4, 5])]
    inits = {}
    if indices is None:
        inputs.append(("idx", [2, 2]))
    else:
        inits["idx"] = indices
    m = model(nodes, inputs, [("y", [2, 2, 5])], inits)
    if indices is None:  # an int64 graph input
        m.graph.input[1].type.tensor_type.elem_type = 7
    return m


def test_host_index_tuples_become_host_offsets_and_one_gather():
    idx = np.array([[[0, 3], [2, -1]], [[1, 0], [-3, 2]]], dtype=np.int64)  # negative indices count from the end
    before, after = check_pass(gather_nd_host_index, _gather_nd(idx), {"x": rand(3, 4, 5)})
    assert ops(before) == ["GatherND"]
    assert ops(after) == ["Shape", "kiln::GatherNDOffsets", "kiln::GatherNDRows"]
    assert all(n.sources == ["mask_gather"] for n in after.nodes)


def test_data_dependent_index_tuples_are_left_alone():
    _, after = check_pass(gather_nd_host_index, _gather_nd(), {"x": rand(3, 4, 5), "idx": np.array([[0, 1], [2, 3]])})
    assert ops(after) == ["GatherND"]


def test_an_out_of_range_index_names_the_node():
    graph = model_to_graph(_gather_nd(np.array([[0, 4]], dtype=np.int64)))
    gather_nd_host_index.run(graph)
    env = dict(graph.initializers, x=torch.as_tensor(rand(3, 4, 5)))
    with pytest.raises(KilnError, match="'mask_gather.offsets'.*index 4 is out of range for data axis 1 of size 4"):
        execute(graph.nodes, env)


def test_index_tuples_in_row_order_only_reshape_the_data():
    """HF BERT's padding mask gathers (b, k) for every b and k in order: the result is a view of the data."""
    idx = np.stack(np.meshgrid(np.arange(3), np.arange(4), indexing="ij"), -1).reshape(3, 1, 4, 2).astype(np.int64)
    m = model([helper.make_node("GatherND", ["x", "idx"], ["y"])], [("x", [3, 4, 5])], [("y", [3, 1, 4, 5])],
              {"idx": idx})
    _, after = check_pass(gather_nd_host_index, m, {"x": rand(3, 4, 5)})
    x = torch.as_tensor(rand(3, 4, 5))
    env = dict(after.initializers, x=x)
    execute(after.nodes, env)
    assert env["y"].shape == (3, 1, 4, 5) and env["y"].data_ptr() == x.data_ptr()  # no copy
