"""The generated elementwise kernel on strided and broadcast inputs, and each op a program may use, against the
reference (each op's own registry implementation, run by kiln::Elementwise's reference). Tiny shapes: on the CPU
these run in Triton's interpreter."""

import math

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import elementwise
from kiln.ops.fused import elementwise as reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CL = torch.channels_last


def _check(program, inputs, block=64, **tol):
    node = Node("Elementwise", [f"x{k}" for k in range(len(inputs))], ["y"], {"program": program}, domain="kiln")
    want = reference(node, *inputs)
    assert elementwise.supports(inputs)
    got = elementwise.run(program, inputs, block=block)
    torch.testing.assert_close(got, want, **(tol or {"rtol": 1e-5, "atol": 1e-5}))
    return got


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def test_squeeze_excite_scale_on_channels_last_keeps_channels_last():
    x = _randn(2, 24, 5, 7).contiguous(memory_format=CL)
    s = _randn(2, 24, 1, 1, seed=1)
    out = _check(["HardSigmoid t0 i1 c0.1666666716337204 c0.5", "Mul t1 i0 t0"], [x, s])
    assert out.is_contiguous(memory_format=CL) and not out.is_contiguous()
    p = elementwise.plan([x, s], out)
    assert p.sizes == (2, 35, 24) and p.layout.patterns == ("=", "s01")  # [N, H*W, C]: the scale read per (n, c)


@pytest.mark.parametrize("other", [(1, 6, 1, 1), (6, 1, 1), (2, 1, 5, 1), (1, 1, 1, 7), (2, 6, 1, 7), ()])
def test_broadcast_in_the_middle_against_either_layout(other):
    for fmt in (torch.contiguous_format, CL):
        x = _randn(2, 6, 5, 7).contiguous(memory_format=fmt)
        b = _randn(*other, seed=2)
        for inputs in ([x, b], [b, x]):
            out = _check(["Mul t0 i0 i1", "Sub t1 t0 i1", "Relu t2 t1"], inputs)
            assert out.stride() == x.stride()


def test_channel_slice_of_a_split_plus_an_activation():
    # a C2f block's residual: one half of a channels-last Split (a strided view) plus a convolution's output
    big = _randn(2, 16, 5, 5).contiguous(memory_format=CL)
    half, _ = big.split(8, dim=1)
    c = _randn(2, 8, 5, 5, seed=3).contiguous(memory_format=CL)
    out = _check(["Add t0 i0 i1"], [half, c])
    assert out.is_contiguous(memory_format=CL)
    assert elementwise.plan([half, c], out).layout.patterns == ("s1", "=")  # [N*H*W, C] rows of 8 of 16


def test_transposed_and_sliced_views():
    t = _randn(3, 40, 6).transpose(1, 2)  # [3, 6, 40], dims in memory order 0, 2, 1
    u = _randn(6, 1, seed=4)
    _check(["Mul t0 i0 i1", "Add t1 t0 c1.5"], [t, u], block=16)
    s = _randn(4, 9, 10)[:, 1:8:2, ::3]  # steps in every dim
    _check(["Neg t0 i0", "Exp t1 t0"], [s], block=8)


def test_a_scalar_input_and_an_all_broadcast_program():
    x, one = _randn(3, 33), _randn(1, 1, seed=5)
    _check(["Mul t0 i0 i1", "Tanh t1 t0"], [x, one], block=32)
    # every input is one value: each output element is that one result
    _check(["Add t0 i0 i1", "Exp t1 t0"], [one, _randn(1, seed=6)], block=32)


def test_dims_merge_before_the_rank_limit():
    x = _randn(2, 2, 2, 2, 2, 2, 2, 2)  # 8 dims of one contiguous tensor: one dim
    assert elementwise.plan([x], torch.empty_like(x)).layout.rank == 1
    _check(["Sqrt t0 i0"], [x.abs()])
    y = _randn(2, 1, 2, 1, 2, 1, 2, 1, 2, seed=7)
    z = _randn(1, 3, 1, 3, 1, 3, 1, 3, 1, seed=8)  # alternating broadcasts: 9 dims that cannot merge
    assert not elementwise.supports([y, z])


def test_where_with_a_bool_condition():
    x = _randn(2, 3, 8)
    mask = (_randn(1, 1, 8, seed=9) > 0)
    _check(["Where t0 i0 c-inf i1", "Sigmoid t1 t0"], [mask, x])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_compute_in_fp32(dtype):
    x = _randn(2, 16, 3, 3, dtype=dtype).contiguous(memory_format=CL)
    s = _randn(2, 16, 1, 1, seed=10, dtype=dtype)
    out = _check(["Sigmoid t0 i1", "Mul t1 i0 t0"], [x, s], rtol=1e-2, atol=1e-2)
    assert out.dtype == dtype


def test_mixed_float_types_and_integers_are_refused():
    a = _randn(3, 5)
    assert not elementwise.supports([a, _randn(5).half()])
    assert not elementwise.supports([a, torch.ones(5, dtype=torch.int64, device=DEV)])
    assert not elementwise.supports([a, torch.ones(3, 0, device=DEV)])


def test_wide_offsets_are_chosen_for_large_spans():
    x = torch.empty_strided((2, 3), (2**31, 1), device="meta")
    out = torch.empty((2, 3), device="meta")
    assert elementwise.plan([x], out).layout.wide
    assert not elementwise.plan([torch.empty((2, 3), device="meta")], out).layout.wide
    assert "tl.program_id(0).to(tl.int64)" in elementwise.source(
        ["Neg t0 i0"], 1, elementwise.plan([x], out).layout)


# --- each op against torch --------------------------------------------------------------------------------------
X = torch.linspace(-6, 6, 97)
OPS = [
    ("HardSwish t0 i0", torch.nn.functional.hardswish),
    ("HardSigmoid t0 i0 c0.2 c0.5", lambda x: torch.clamp(0.2 * x + 0.5, 0, 1)),
    ("LeakyRelu t0 i0 c0.1", lambda x: torch.nn.functional.leaky_relu(x, 0.1)),
    ("Elu t0 i0 c1.5", lambda x: torch.nn.functional.elu(x, 1.5)),
    ("Clip t0 i0 c-1.0 c2.5", lambda x: torch.clamp(x, -1.0, 2.5)),
    ("Clip t0 i0 c-inf c0.5", lambda x: torch.clamp(x, max=0.5)),
    ("Softplus t0 i0", torch.nn.functional.softplus),
    ("Gelu t0 i0", torch.nn.functional.gelu),
    ("GeluTanh t0 i0", lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    ("Sign t0 i0", torch.sign),
    ("Floor t0 i0", torch.floor),
    ("Ceil t0 i0", torch.ceil),
    ("Pow t0 i0 c2.0", lambda x: x ** 2),
    ("Pow t0 i0 c3.0", lambda x: x ** 3),
    ("Pow t0 i0 c-2.0", lambda x: x ** -2),
    ("Pow t0 i0 c0.0", lambda x: x ** 0),
    ("Pow t0 i0 c0.5", lambda x: x.abs() ** 0.5),
    ("Pow t0 i0 c1.7", lambda x: x ** 1.7),
]


@pytest.mark.parametrize("line, fn", OPS, ids=[line.split()[0] + "_" + "_".join(line.split()[3:]) for line, _ in OPS])
def test_each_op_against_torch(line, fn):
    x = (X + 0.01).to(DEV)  # no value exactly at a kink or an integer
    if line == "Pow t0 i0 c0.5":
        x = x.abs()
    got = elementwise.run([line], [x], block=32)
    want = fn(x)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, equal_nan=True)
    node = Node("Elementwise", ["x"], ["y"], {"program": [line]}, domain="kiln")
    torch.testing.assert_close(reference(node, x), want, rtol=2e-5, atol=2e-5, equal_nan=True)


def test_pow_of_a_negative_base():
    x = torch.tensor([-2.0, -0.5, 0.0, 3.0], device=DEV)
    torch.testing.assert_close(elementwise.run(["Pow t0 i0 c3.0"], [x]), x ** 3)
    got = elementwise.run(["Pow t0 i0 c1.5"], [x])
    assert math.isnan(got[0]) and math.isnan(got[1]) and got[2] == 0


# --- a program's literal arguments are data too -----------------------------------------------------------------
@pytest.mark.parametrize("program, why", [
    (["Pow t0 i0 i1"], "reads 'i1' as its argument 1, which must be a number"),
    (["HardSigmoid t0 i0 t0 c0.5"], "reads 't0'"),
    (["HardSigmoid t0 i0 i1 c0.5"], "as its argument 1, which must be a number"),
    (["LeakyRelu t0 i0"], "has 1 argument(s), LeakyRelu takes 2"),
    (["Where t0 i0 i1"], "has 2 argument(s), Where takes 3"),
    (["Clip t0 i0 c0 c1 c2"], "has 4 argument(s), Clip takes 3"),
    (["Gelu t0 i0 c__import__"], "has 2 argument(s)"),
    (["Elu t0 i0 c1.0;import"], "reads 'c1.0;import'"),
])
def test_a_malformed_line_is_refused(program, why):
    import re

    from kiln.errors import EngineFileError

    with pytest.raises(EngineFileError, match=re.escape(why)):
        elementwise.source(program, 2)


def test_a_malformed_layout_is_refused():
    with pytest.raises(ValueError, match="is not a layout"):
        elementwise.source(["Neg t0 i0"], 1, elementwise.Layout(2, ("0x",)))
    with pytest.raises(ValueError, match="is not a layout"):
        elementwise.source(["Neg t0 i0"], 1, elementwise.Layout(elementwise.MAX_RANK + 1, ("=",)))


# --- compiled for real: the layouts of the zoo's CNNs at FP16 ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["se_scale", "hard_sigmoid_scale", "split_residual", "rope_like", "flat"])
def test_zoo_layouts_on_the_gpu(case):
    h = torch.float16
    if case in ("se_scale", "hard_sigmoid_scale"):  # EfficientNet's / MobileNetV3's squeeze-excite
        x, s = _randn(4, 96, 28, 28, dtype=h).contiguous(memory_format=CL), _randn(4, 96, 1, 1, seed=1, dtype=h)
        program = ["Mul t0 i0 i1"] if case == "se_scale" else ["HardSigmoid t0 i1 c0.1666666716337204 c0.5",
                                                              "Mul t1 i0 t0"]
        inputs = [x, s]
    elif case == "split_residual":  # a C2f block: half of a channels-last Split plus a convolution's output
        half = _randn(4, 64, 20, 20, dtype=h).contiguous(memory_format=CL).split(32, dim=1)[1]
        inputs, program = [half, _randn(4, 32, 20, 20, seed=2, dtype=h).contiguous(memory_format=CL)], ["Add t0 i0 i1"]
    elif case == "rope_like":  # q of a head split (a transposed view) times a [S, D] table
        q = _randn(2, 48, 4, 64, dtype=h).transpose(1, 2)
        inputs, program = [q, _randn(48, 64, seed=3, dtype=h)], ["Mul t0 i0 i1", "Add t1 t0 i0"]
    else:
        inputs, program = [_randn(3, 1000, 77, dtype=h), _randn(3, 1000, 77, seed=4, dtype=h)], ["Add t0 i0 i1"]
    _check(program, inputs, block=elementwise.BLOCK, rtol=2e-3, atol=2e-3)


def test_tiles_fit_the_inner_dim():
    assert elementwise.tile_cols(1152, 2048) == 128  # 9 full tiles, not one of 2048 with 896 lanes idle
    assert elementwise.tile_cols(16, 2048) == 16 and elementwise.tile_cols(7, 2048) == 8
    assert elementwise.tile_cols(10**6, 2048) == 2048
    x, s = _randn(3, 1152, 1, 2).contiguous(memory_format=CL), _randn(3, 1152, 1, 1, seed=1)
    out = _check(["Mul t0 i0 i1"], [x, s], block=2048)  # channels innermost: tiles of 128 of them
    assert elementwise.plan([x, s], out).sizes == (3, 2, 1152)


@pytest.mark.gpu
def test_the_squeeze_excite_kernel_is_not_slower_than_torch_on_the_gpu():
    """GPU time of CUDA-graph replays (no host work): the generated kernel against torch's strided kernel on
    EfficientNet-B0's largest squeeze-excite scale at batch 32. A loose bound: a regression of several times
    fails, ordinary noise does not."""
    x = _randn(32, 32, 112, 112, dtype=torch.float16).contiguous(memory_format=CL)
    s = _randn(32, 32, 1, 1, seed=1, dtype=torch.float16)
    elementwise.run(["Mul t0 i0 i1"], [x, s])  # compiled outside the capture

    def replay_ms(fn, calls=20):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        times = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / calls)
        return sorted(times)[2]

    generated = replay_ms(lambda: elementwise.run(["Mul t0 i0 i1"], [x, s]))
    eager = replay_ms(lambda: x * s)
    assert generated < 1.5 * eager, f"generated {1000 * generated:.1f} us, torch {1000 * eager:.1f} us"
