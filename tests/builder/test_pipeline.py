"""The build's one pass list (builder/pipeline.py), and the graph after each pass (--dumpPasses)."""

import subprocess
import sys

import onnx
import torch

from kiln import passes
from kiln.builder import pipeline
from kiln.builder.dump import dump_graph
from kiln.ir.graph import Graph, Node, Value

from ..models import mlp


def test_one_list_from_the_loaded_graph_to_the_laid_out_graph():
    names = [p.name for p in pipeline.PASSES]
    rewrites = [p.__name__.rsplit(".", 1)[-1] for p in passes.PIPELINE]
    assert names == ["pin_layer_precisions", "calibration", *rewrites, "placement", "footprint", "precision",
                     "quantized_io", "channels_last_weights", "padded_channel_weights", "column_major_weights"]
    at = rewrites.index("fuse_qdq")  # fuse_qdq folds nothing itself: the next pass does
    assert rewrites[at + 1] == "fold_dequantized_weights"


def test_qdq_export_runs_the_lists_leading_passes_that_write_standard_onnx():
    from kiln.passes import insert_qdq, stem_patches

    leading = passes.up_to(insert_qdq, standard_onnx=True)
    kiln_only = {"kiln.passes.gather_nd_host_index", "kiln.passes.gather_window_rows"}  # rewrites for Kiln's runtime
    assert leading == [p for p in passes.PIPELINE[:passes.PIPELINE.index(insert_qdq) + 1] if p is not stem_patches
                       and p.__name__ not in kiln_only]


def test_kiln_build_dump_passes_writes_the_graph_after_each_pass(tmp_path):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp().SerializeToString())
    dump = tmp_path / "passes"
    p = subprocess.run([sys.executable, "-m", "kiln", "build", f"--onnx={model}", "--shapes=x:2x8", "--device=cpu",
                        f"--dumpPasses={dump}", "--iterations=1"], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    files = sorted(f.name for f in dump.iterdir())
    assert files == ["00-loaded.onnx"] + [f"{i:02d}-{s.name}.onnx" for i, s in enumerate(pipeline.PASSES, 1)]

    def ops(name):
        return [(n.domain + "::" if n.domain else "") + n.op_type for n in onnx.load(str(dump / name)).graph.node]

    at = {s.name: f"{i:02d}-{s.name}.onnx" for i, s in enumerate(pipeline.PASSES, 1)}
    assert ops("00-loaded.onnx") == ops(at["fuse_qdq"]) == ["MatMul", "Add", "Relu", "MatMul", "Add"]
    assert ops(at["fuse_gemm"]) == ["kiln::FusedGemm", "kiln::FusedGemm"]
    last = onnx.load(str(dump / at["column_major_weights"])).graph
    # each node's precision and placement; the weights' names, types and shapes (the large ones declared as inputs)
    assert [n.doc_string for n in last.node] == ["precision float32, placement device"] * 2
    declared = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in last.input}
    assert declared["w1"] == [8, 16] and {t.name: list(t.dims) for t in last.initializer}["b1"] == [16]


def test_a_graph_onnx_cannot_hold_is_written_as_text(tmp_path):
    graph = Graph([Node("Relu", ["x"], ["y"], {"odd": [1, "mixed"]}, name="r")],  # no ONNX attribute type
                  [Value("x", torch.float32, (2,))], [Value("y", torch.float32, (2,))])
    path = dump_graph(graph, tmp_path, "07-some_pass")
    assert path.name == "07-some_pass.txt"
    text = path.read_text()
    assert "not writable as ONNX" in text and "r: y = Relu(x)" in text and "input x: float32[2]" in text
