"""Weight quantization: round-trip errors of each format, F.linear on a QuantizedWeight against the float
matmul, AWQ's scale search against plain 4-bit rounding, and a quantized tiny Llama against its float self."""

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.llm import quantize as q


def _weight(out=96, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, n, generator=g) * 0.05


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("method, bound", [("fp8", 0.04), ("int8", 0.01)])
def test_weight_round_trip(method, bound):
    w = _weight()
    qw = q.quantize_weight(w, method)
    assert qw.codes.dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int8)
    assert qw.scale.shape == (96,)
    assert _rel(qw.dequantize(), w) < bound
    # per output channel: a row 100x larger than the others keeps its own precision
    w[3] *= 100
    qw = q.quantize_weight(w, method)
    assert _rel(qw.dequantize()[:3], w[:3]) < bound


def test_int4_packing_and_short_last_group():
    w = _weight(out=8, n=200)  # 200 = one group of 128 and a short group of 72
    packed, scale, zero = q.quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 128)  # 256 padded codes, two a byte
    assert scale.shape == zero.shape == (8, 2)
    back = q.dequantize_int4(packed, scale, zero, 200)
    assert back.shape == w.shape
    step = scale.repeat_interleave(128, dim=1)[:, :200]
    assert ((back - w).abs() <= step / 2 + 1e-6).all()  # every value within half a step of its group
    assert _rel(back, w) < 0.12


def test_linear_dispatch_matches_float():
    """F.linear(x, QuantizedWeight) runs the quantized matmul and stays close to the float product."""
    torch.manual_seed(0)
    w, b = _weight(out=64, n=256), torch.randn(64) * 0.1
    x = torch.randn(5, 7, 256)
    ref = F.linear(x, w, b)
    acts = torch.randn(512, 256)
    from kiln.llm.calibrate import ActivationStats

    stats = ActivationStats(acts.abs().amax(0), acts)
    for method, bound in (("fp8", 0.04), ("int8", 0.01), ("w8a8", 0.03), ("int4-awq", 0.12)):
        qw = q.quantize_weight(w, method, stats)
        y = F.linear(x, qw, b)
        assert type(y) is torch.Tensor and y.shape == ref.shape, method
        assert _rel(y, ref) < bound, (method, _rel(y, ref))
        # the storage is the codes: a step reads fewer bytes than the FP32 weight's
        assert qw.numel() * qw.element_size() <= w.numel() * (2 if method == "int4-awq" else 4) // 4 + 1


def test_w8a8_smoothing_moves_outliers_into_the_weight():
    """An activation channel 50x larger than the rest: per-token INT8 without smoothing loses the small
    channels; SmoothQuant's factors (alpha 0.5) bring the error down."""
    torch.manual_seed(1)
    w = _weight(out=64, n=128)
    x = torch.randn(256, 128)
    x[:, 5] *= 50
    ref = F.linear(x, w)
    stats_absmax = x.abs().amax(0)
    smoothed = q.quantize_w8a8(w, stats_absmax)
    flat = q.quantize_w8a8(w, torch.ones(128) * (w.abs().amax(0) ** 1.0))  # s = 1: no smoothing
    assert torch.allclose(1 / flat.input_scale, torch.ones(128), atol=1e-5)
    assert _rel(F.linear(x, smoothed), ref) < 0.7 * _rel(F.linear(x, flat), ref)


def test_awq_search_beats_plain_rounding_on_skewed_activations():
    torch.manual_seed(2)
    w = _weight(out=64, n=256)
    x = torch.randn(512, 256)
    x[:, :8] *= 20  # salient channels
    ref = F.linear(x, w)
    awq = q.quantize_int4_awq(w, x)
    packed, scale, zero = q.quantize_int4(w)
    plain = q.dequantize_int4(packed, scale, zero, 256)
    assert _rel(F.linear(x, awq), ref) < _rel(F.linear(x, plain), ref)


def test_refusals():
    with pytest.raises(ConfigError, match="--weights int4-awq needs calibration"):
        q.quantize_weight(_weight(), "int4-awq")
    with pytest.raises(ConfigError, match="not one of"):
        q.check_method("int3")


def test_quantized_tiny_llama_logits_close_to_float(tiny_llama):
    """Every decoder matrix replaced in place; model.py's F.linear calls run the quantized matmuls."""
    from kiln.llm.calibrate import activation_stats
    from kiln.llm.config import ModelConfig
    from kiln.llm.loader import load_hf_dir
    from kiln.llm.model import DecoderModel
    from kiln.llm.perplexity import PagedSequence

    hf, tensors, tok = load_hf_dir(tiny_llama)
    cfg = ModelConfig.from_hf(hf)
    ids = torch.tensor(tok.encode("The quick brown fox jumps over the lazy dog. Hello world!"))

    def logits(model):
        seq = PagedSequence.allocate(model, ids.numel(), torch.float32)
        return model.compute_logits(seq.prefill(model, ids, chunk=8))

    ref_model = DecoderModel(cfg, tensors, torch.float32, "cpu")
    ref = logits(ref_model)
    stats = activation_stats(ref_model, ids)
    assert set(stats) == set(q.linear_weights(ref_model))
    assert stats["layers.0.qkv"].sample.shape[1] == cfg.hidden_size
    for method, bound in (("fp8", 0.1), ("int8", 0.03), ("w8a8", 0.04), ("int4-awq", 0.35)):
        model = DecoderModel(cfg, tensors, torch.float32, "cpu")
        quantized = q.quantize_model(model, method, stats)
        assert len(quantized) == 4 * cfg.num_layers
        assert all(isinstance(w, q.QuantizedWeight) for w in q.linear_weights(model).values())
        out = logits(model)
        assert _rel(out, ref) < bound, (method, _rel(out, ref))
        if method != "int4-awq":  # 4 bits of a random (structureless) matrix move many top-1 choices
            assert out.argmax(-1).eq(ref.argmax(-1)).float().mean() > 0.9, method


def test_cuda_matmul_forms_on_cpu():
    """The CUDA paths' arithmetic, run where torch offers it on the CPU: FP8 x FP8 through torch._scaled_mm with
    per-token and per-channel scales, and W8A8's integer product (torch._int_mm) equal to the FP32 emulation."""
    torch.manual_seed(3)
    w, x = _weight(out=64, n=128), torch.randn(32, 128)
    qw = q.quantize_fp8(w)
    try:
        y = q._fp8_matmul(x.to(torch.bfloat16), qw)
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU torch._scaled_mm")
    assert y.dtype == torch.bfloat16 and _rel(y.float(), F.linear(x, w)) < 0.06
    a = torch.randint(-127, 128, (32, 128), dtype=torch.int8)
    b = q.quantize_w8a8(w, x.abs().amax(0)).codes
    assert torch.equal(torch._int_mm(a, b.t()).float(), a.float() @ b.float().t())
