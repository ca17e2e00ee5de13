"""Helpers for pass tests: build a graph, run a pass, compare numerics before/after."""

import copy

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.engine.interpreter import execute
from kiln.ir.from_onnx import model_to_graph


def model(nodes, inputs, outputs, inits=None, opset=17):
    """inputs/outputs: [(name, shape)] float32; inits: {name: array}."""
    g = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def run(graph, feeds):
    env = dict(graph.initializers)
    env.update(feeds)
    execute(graph.nodes, env)
    return [env[v.name] for v in graph.outputs]


def check_pass(pass_module, onnx_model, feeds, atol=1e-5):
    """Run the pass; assert outputs unchanged. Returns (graph before, graph after)."""
    before = model_to_graph(onnx_model)
    after = copy.deepcopy(before)
    pass_module.run(after)
    feeds = {k: torch.as_tensor(v) for k, v in feeds.items()}
    for a, b in zip(run(before, feeds), run(after, feeds)):
        torch.testing.assert_close(b, a, atol=atol, rtol=1e-4)
    return before, after


def ops(graph):
    return [(n.domain + "::" if n.domain else "") + n.op_type for n in graph.nodes]


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


__all__ = ["check_pass", "helper", "model", "ops", "rand", "onnx"]
