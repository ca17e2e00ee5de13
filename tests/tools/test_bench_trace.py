"""bench/trace.py's layer mapping: each layer's kernels found, in order, in a replay's timeline."""

from bench.trace import per_layer, tactic_family


def test_layers_map_to_the_replay_past_an_eager_copy_the_replay_does_not_make():
    rows = [{"kernel": k, "us": us} for k, us in (("gather", 1.0), ("gemm", 2.0), ("norm", 3.0), ("gemm", 4.0))]
    layers = [("embedding", ["Memcpy HtoD (Pageable -> Device)", "gather"]), ("fc1", ["gemm", "norm"]),
              ("fc2", ["gemm"])]
    mapped, stopped = per_layer(layers, rows)
    assert stopped == "" and [(m["layer"], m["us"]) for m in mapped] == [("embedding", 1.0), ("fc1", 5.0),
                                                                         ("fc2", 4.0)]


def test_mapping_stops_at_a_kernel_the_replay_lacks():
    mapped, stopped = per_layer([("a", ["gemm"]), ("b", ["softmax"])], [{"kernel": "gemm", "us": 1.0}])
    assert [m["layer"] for m in mapped] == ["a"] and stopped.startswith("mapping stopped at b")


def test_tactic_families_drop_the_configuration():
    assert tactic_family("triton_tma_qconv1x1_128x128x64_w4_s3") == "triton_tma_qconv1x1"
    assert tactic_family("triton_tma_qconv_8x32x64x128_w4_s3") == "triton_tma_qconv"
    assert tactic_family("cudnn_graph_plan1") == "cudnn_graph"
    assert tactic_family("cublaslt_fp8_epilogue_algo3_no_workspace") == "cublaslt_fp8_epilogue"
    assert tactic_family("triton_conv_splitk_s8_64x64x64_w4_s4") == "triton_conv_splitk"
    assert tactic_family("mean_then_cublaslt") == "mean_then_cublaslt"


def test_the_layer_table_sums_builder_and_replay_times_by_tactic_family():
    from types import SimpleNamespace

    from bench.trace import layer_table

    chosen = {"a": ("triton_tma_qconv1x1_128x128x64_w4_s3", 0.020),  # the builder's choice and its timing, ms
              "b": ("triton_tma_qconv1x1_64x128x128_w4_s2", 0.010), "c": ("cudnn_graph_plan0", 0.010)}
    engine = SimpleNamespace(tactics=[{"layer": k, "chosen": t, "timings": {t: ms}} for k, (t, ms) in chosen.items()])
    layers = [{"layer": "a", "kernels": 1, "us": 15.0}, {"layer": "b", "kernels": 1, "us": 6.0},
              {"layer": "c", "kernels": 1, "us": 9.0}]
    lines = layer_table(engine, layers, "")
    assert "| triton_tma_qconv1x1 | 2 | 30.0 | 21.0 | 0.70 |" in lines
    assert "| cudnn_graph | 1 | 10.0 | 9.0 | 0.90 |" in lines
