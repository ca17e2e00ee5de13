"""bench/trace.py's layer mapping: each layer's kernels found, in order, in a replay's timeline."""

from bench.trace import per_layer


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
