"""The IR's ONNX conversions: dtypes, 0-d tensors, round trip through ONNX."""

import numpy as np
import onnx
import torch

from kiln.ir import dtypes
from kiln.ir.from_onnx import model_to_graph
from kiln.ir.to_onnx import graph_to_model

from .models import mlp


def test_zero_dimensional_arrays_stay_scalars():
    assert dtypes.to_torch(np.array(3, dtype=np.int64)).shape == ()
    assert dtypes.to_torch(np.array(1.5, dtype=np.float32)).shape == ()


def test_graph_round_trips_through_onnx():
    g = model_to_graph(mlp())
    back = graph_to_model(g)
    onnx.checker.check_model(back)
    g2 = model_to_graph(back)
    assert [n.op_type for n in g2.nodes] == [n.op_type for n in g.nodes]
    for k, t in g.initializers.items():
        torch.testing.assert_close(g2.initializers[k], t)
