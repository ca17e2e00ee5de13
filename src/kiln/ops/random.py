"""Random generators, and the signal ops: windows, DFT, STFT, mel filter bank.

A random op with a `seed` attribute draws from its own generator seeded with it
on every run, so its output is reproducible (run to run and engine to engine);
without one it draws from torch's global generator.
"""

import math

import onnx
import torch

from ..ir import dtypes
from .registry import register

TP = onnx.TensorProto


def _generator(node, device) -> torch.Generator | None:
    seed = node.attr("seed")
    if seed is None:
        return None
    g = torch.Generator(device=device)
    # All 32 bits of the float seed, so 1.5 and 1.0 give different streams.
    g.manual_seed(torch.tensor(seed, dtype=torch.float32).view(torch.int32).item())
    return g


def _like_dtype(node, x) -> torch.dtype:
    if node.attr("dtype") is not None:
        return dtypes.onnx_to_torch(node.attr("dtype"))
    if not x.dtype.is_floating_point:
        raise ValueError(f"{node.op_type} input is {x.dtype}; give a float `dtype` attribute")
    return x.dtype


def _normal(node, shape, dtype, device):
    z = torch.randn(shape, dtype=torch.promote_types(dtype, torch.float32), device=device,
                    generator=_generator(node, device))
    return (z * node.attr("scale", 1.0) + node.attr("mean", 0.0)).to(dtype)


def _uniform(node, shape, dtype, device):
    u = torch.rand(shape, dtype=torch.promote_types(dtype, torch.float32), device=device,
                   generator=_generator(node, device))
    low, high = node.attr("low", 0.0), node.attr("high", 1.0)
    return (u * (high - low) + low).to(dtype)


def _check_shape(node) -> str | None:
    return None if node.attr("shape") is not None else f"{node.op_type} needs a 'shape' attribute"


@register("RandomNormal", nondeterministic=True, check=_check_shape)
def random_normal(node):
    return _normal(node, node.attr("shape"), dtypes.onnx_to_torch(node.attr("dtype", TP.FLOAT)), node.device)


@register("RandomUniform", nondeterministic=True, check=_check_shape)
def random_uniform(node):
    return _uniform(node, node.attr("shape"), dtypes.onnx_to_torch(node.attr("dtype", TP.FLOAT)), node.device)


@register("RandomNormalLike", nondeterministic=True)
def random_normal_like(node, x):
    return _normal(node, x.shape, _like_dtype(node, x), x.device)


@register("RandomUniformLike", nondeterministic=True)
def random_uniform_like(node, x):
    return _uniform(node, x.shape, _like_dtype(node, x), x.device)


@register("Bernoulli", nondeterministic=True, since=15)
def bernoulli(node, p):
    # u < p: probabilities outside [0, 1] act as 0 or 1 instead of failing.
    u = torch.rand(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device,
                   generator=_generator(node, p.device))
    dtype = node.attr("dtype")
    return (u < p).to(dtypes.onnx_to_torch(dtype) if dtype is not None else p.dtype)


@register("Multinomial", nondeterministic=True, since=7)
def multinomial(node, logits):
    # Each row holds unnormalized log-probabilities; samples are drawn with replacement.
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    samples = torch.multinomial(probs, node.attr("sample_size", 1), replacement=True,
                                generator=_generator(node, logits.device))
    return samples.to(dtypes.onnx_to_torch(node.attr("dtype", TP.INT32)))


# ----------------------------------------------------------------- windows


def _window(node, size, terms) -> torch.Tensor:
    """sum_k a_k * cos(2*pi*k*n / N): N = size (periodic) or size - 1 (symmetric)."""
    size = int(size)
    denom = max(size if node.attr("periodic", 1) else size - 1, 1)  # a 1-point window is its n = 0 value
    phase = torch.arange(size, dtype=torch.float64, device=node.device) * (2 * math.pi / denom)
    w = sum(a * torch.cos(k * phase) for k, a in enumerate(terms))
    return w.to(dtypes.onnx_to_torch(node.attr("output_datatype", TP.FLOAT)))


@register("HannWindow", host_inputs=(0,), since=17)
def hann_window(node, size):
    return _window(node, size, (0.5, -0.5))


@register("HammingWindow", host_inputs=(0,), since=17)
def hamming_window(node, size):
    return _window(node, size, (25 / 46, -21 / 46))


@register("BlackmanWindow", host_inputs=(0,), since=17)
def blackman_window(node, size):
    return _window(node, size, (0.42, -0.5, 0.08))


# ------------------------------------------------------------------ spectra


def _as_complex(x: torch.Tensor) -> torch.Tensor:
    """[..., 1] (real) or [..., 2] (real, imaginary) -> a real or complex tensor without that axis."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x[..., 0] if x.shape[-1] == 1 else torch.complex(x[..., 0], x[..., 1])


def _check_dft(node):
    if node.attr("onesided", 0) not in (0, 1) or node.attr("inverse", 0) not in (0, 1):
        return "DFT onesided and inverse must be 0 or 1"
    return None


@register("DFT", host_inputs=(1, 2), check=_check_dft, since=17)
def dft(node, x, dft_length=None, axis=None):
    """Fourier transform along `axis` of a real ([..., 1]) or complex ([..., 2]) signal; onesided with
    inverse is the real inverse (IRFFT): its output is real."""
    if node.opset < 20:  # the axis was an attribute, counted among the signal axes
        axis = node.attr("axis", 1)
    axis = -2 if axis is None else int(axis.reshape(-1)[0]) if isinstance(axis, torch.Tensor) else int(axis)
    dim = axis % x.dim()
    if dim == x.dim() - 1:
        raise ValueError(f"DFT axis {axis} is the real/imaginary axis")
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    if dft_length is not None:
        n = int(dft_length.reshape(-1)[0]) if isinstance(dft_length, torch.Tensor) else int(dft_length)
    else:
        n = 2 * (x.shape[dim] - 1) if inverse and onesided else x.shape[dim]
    signal = _as_complex(x)
    if inverse and onesided:
        return torch.fft.irfft(signal, n=n, dim=dim).unsqueeze(-1).to(x.dtype)
    y = torch.fft.ifft(signal, n=n, dim=dim) if inverse else torch.fft.fft(signal, n=n, dim=dim)
    if onesided:
        y = y.narrow(dim, 0, n // 2 + 1)
    return torch.stack([y.real, y.imag], dim=-1).to(x.dtype)


@register("STFT", host_inputs=(1, 3), since=17)
def stft(node, signal, frame_step, window=None, frame_length=None):
    if frame_length is not None:
        length = int(frame_length)
    else:
        length = window.shape[0] if window is not None else signal.shape[-2]
    x = _as_complex(signal)  # [batch, samples]
    frames = x.unfold(-1, length, int(frame_step))  # [batch, frames, length]
    if window is not None:
        frames = frames * window.to(frames.real.dtype)
    y = torch.fft.fft(frames, n=length, dim=-1)
    if node.attr("onesided", 1):
        y = y[..., : length // 2 + 1]
    return torch.stack([y.real, y.imag], dim=-1).to(signal.dtype)


@register("MelWeightMatrix", host_inputs=(0, 1, 2, 3, 4), since=17)
def mel_weight_matrix(node, num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz):
    bins, n_fft, rate = int(num_mel_bins), int(dft_length), int(sample_rate)

    def to_mel(hz):
        return 2595 * math.log1p(hz / 700) / math.log(10)

    low, high = to_mel(float(lower_edge_hertz)), to_mel(float(upper_edge_hertz))
    # bins + 2 points evenly spaced in mel (ONNX divides the range by bins + 2),
    # mapped back to Hz and then to the index of the DFT bin holding them.
    mel = torch.arange(bins + 2, dtype=torch.float64, device=node.device) * ((high - low) / (bins + 2)) + low
    hz = 700 * torch.expm1(mel / 2595 * math.log(10))
    edge = torch.floor((n_fft + 1) * hz / rate)
    left, center, right = edge[:-2], edge[1:-1], edge[2:]
    j = torch.arange(n_fft // 2 + 1, dtype=torch.float64, device=node.device).unsqueeze(1)
    rising = torch.where((j >= left) & (j <= center), (j - left) / (center - left), 0.0)
    falling = torch.where((j >= center) & (j < right), (right - j) / (right - center), 0.0)
    peak = (j == center).to(torch.float64)  # a filter whose left edge is its center is just 1 there
    w = torch.maximum(torch.maximum(rising.nan_to_num(0.0), falling), peak)
    return w.to(dtypes.onnx_to_torch(node.attr("output_datatype", TP.FLOAT)))
