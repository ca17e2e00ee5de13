"""Weight layouts chosen for a GPU (kiln/builder/layout.py)."""

import numpy as np
import torch

import kiln
from kiln.builder import layout

from ..models import mlp


def _int8_mlp_engine():
    calib = [{"x": np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32)} for i in range(4)]
    prof = kiln.Profile({"x": ((1, 8), (4, 8), (8, 8))})
    return kiln.build(mlp(), kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], int8=True, calib=calib))


def test_quantized_gemm_weights_are_stored_k_major_on_a_gpu_only(tmp_path):
    engine = _int8_mlp_engine()
    qgemm_weights = sorted(n.inputs[1] for n in engine.graph.nodes if n.op_type == "QGemm")
    assert len(qgemm_weights) == 2
    assert layout.column_major_weights(engine.graph, "cuda") == qgemm_weights
    assert layout.column_major_weights(engine.graph, "cpu") == [] == engine.column_major

    engine.column_major = qgemm_weights  # as a GPU build records them; the file keeps the list
    engine.save(tmp_path / "m.kiln")
    again = kiln.load(tmp_path / "m.kiln")
    assert again.column_major == qgemm_weights
    w = again.weights_on_target()[qgemm_weights[0]]  # placed on this machine's target with the layout
    assert w.stride() == (1, w.shape[0]) and torch.equal(w, engine.graph.initializers[qgemm_weights[0]])
    x = torch.randn(3, 8)
    torch.testing.assert_close(again.create_execution_context().run({"x": x})["y"],
                               engine.create_execution_context().run({"x": x})["y"])


def test_an_rgb_stem_reading_the_image_gets_a_zero_fourth_channel_and_the_same_results(tmp_path):
    from kiln.models import DEFAULT_PROFILE, tiny_cnn

    def build():
        return kiln.build(tiny_cnn(), kiln.BuildConfig(device="cpu", progress=False,
                                                       profiles=[kiln.Profile(dict(DEFAULT_PROFILE))]))

    engine = build()
    assert layout.channels_last_weights(engine.graph, "cpu", "float32") == [] == engine.padded_channels
    convs = [n for n in engine.graph.nodes if n.op_type in ("Conv", "FusedConv")]
    nhwc = layout.channels_last_weights(engine.graph, "cuda", "float16")
    assert sorted(n.inputs[1] for n in convs) == nhwc  # both convolutions; only the stem reads the image
    stem = [n.inputs[1] for n in convs if n.inputs[0] == "image"]
    assert layout.padded_channel_weights(engine.graph, nhwc) == stem

    engine.channels_last, engine.padded_channels = nhwc, stem  # as a GPU build records them
    engine.save(tmp_path / "m.kiln")
    again = kiln.load(tmp_path / "m.kiln")
    assert again.padded_channels == stem
    w = again.weights_on_target()[stem[0]]
    assert w.shape[1] == 4 and (w[:, 3] == 0).all() and w.is_contiguous(memory_format=torch.channels_last)
    assert engine.graph.initializers[stem[0]].shape[1] == 3  # the file keeps the model's weight
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(again.create_execution_context().run({"image": x})["probs"],
                               build().create_execution_context().run({"image": x})["probs"])
