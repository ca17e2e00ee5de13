"""Kiln's flash-attention kernel (kiln/kernels/attention.py) at every tile against torch's SDPA back-ends,
on the operands a BERT/ViT engine hands it: q, k, v as head views of one fused QKV projection output
([B*S, 3*H*D] memory, heads interleaved per position) and BERT's additive padding mask [B, 1, 1, S].

Times are kiln.tactics.timer.median_ms (CUDA-graph replays, as the builder's selector times tactics), us.

    python bench/attention_sweep.py > bench/results/H200-attention-sweep.log        (GPU)
    python bench/attention_sweep.py --fp8       (BERT-base b32 only: FP16 against FP8 q/k/v, FP8 output)
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels import attention  # noqa: E402
from kiln.kernels.attention import FlashConfig  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

# (name, batch, sequence, heads, head dim, padding mask)
SHAPES = [("bert-base b32", 32, 128, 12, 64, True), ("bert-base b1", 1, 128, 12, 64, True),
          ("vit-b16 b32", 32, 197, 12, 64, False), ("vit-b16 b1", 1, 197, 12, 64, False)]
TILES = [FlashConfig(m, n, w, s) for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))]


def us(fn) -> str:
    try:
        return f"{median_ms(fn, runs=20) * 1000:.1f}"
    except Exception as e:  # a tile that does not fit or compile here
        return f"fail {type(e).__name__}: {str(e)[:120]}"


def operands(b, s, h, d, masked):
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, S, D] views, as split_heads_as_view
    mask = None
    if masked:
        keep = torch.rand(b, 1, 1, s, device="cuda") > 0.2
        keep[..., 0] = True
        mask = torch.where(keep, 0.0, -10000.0).to(torch.float16)
    return q, k, v, mask


FP8_TILES = [FlashConfig(m, n, 4, s) for m, n, s in itertools.product((64, 128), (32, 64, 128), (2, 3))]


def fp8_inputs() -> None:
    """BERT-base b32 in an FP8 engine: q, k, v as FP16 or as the merged projection's FP8 codes (q k^T on the
    codes' FP8 tensor cores, or on codes converted to FP16 as they are loaded), the output as FP8 codes for the
    output projection."""
    q, k, v, mask = operands(32, 128, 12, 64, True)
    scale = torch.tensor(max(t.abs().max().item() for t in (q, k, v)) / 448, device="cuda")
    q8, k8, v8 = ((t.float() / scale).to(attention.FP8) for t in (q, k, v))  # same views of one [B, S, 3, H, D]
    y_scale = torch.tensor(0.01, device="cuda")
    ref = attention.reference(q8, k8, v8, mask, qkv_scale=scale).float()
    print("\n## bert-base b32, FP8 output (y_scale), us: fp16 q/k/v | fp8 codes, q k^T in FP8 | fp8 codes, "
          "converted to FP16")
    for c in FP8_TILES:
        cells = []
        for args, kw in (((q, k, v), {}), ((q8, k8, v8), dict(qkv_scale=scale)),
                         ((q8, k8, v8), dict(qkv_scale=scale, fp8_qk=False))):
            def run(args=args, kw=kw, c=c):
                return attention.flash_attention(*args, mask, config=c, y_scale=y_scale, qtype="fp8", **kw)
            try:
                err = (run().float() * y_scale - ref).abs().max().item() if kw else 0.0
                cells.append(f"{us(run)}" + (f" (err {err:.1e})" if kw else ""))
            except Exception as e:
                cells.append(f"fail {type(e).__name__}: {str(e)[:80]}")
        print(f"triton {c.name} | " + " | ".join(cells))


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "--fp8" in sys.argv:
        return fp8_inputs()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, b, s, h, d, masked in SHAPES:
        q, k, v, mask = operands(b, s, h, d, masked)
        ref = attention.reference(q, k, v, mask).float()
        print(f"\n## {name}: q/k/v [{b}, {h}, {s}, {d}] views of [B, S, 3, H, D]{', mask [B,1,1,S]' if masked else ''}")
        for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            def run(backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            try:
                err = (run().float() - ref).abs().max().item()
                print(f"sdpa {backend.lower()} {us(run)} (err {err:.1e})")
            except RuntimeError as e:
                print(f"sdpa {backend.lower()} n/a ({str(e).splitlines()[0][:80]})")
        for c in TILES:
            def run(c=c):
                return attention.flash_attention(q, k, v, mask, config=c)
            try:
                err = (run().float() - ref).abs().max().item()
            except Exception as e:
                print(f"triton {c.name} fail {type(e).__name__}: {str(e)[:100]}")
                continue
            print(f"triton {c.name} {us(run)} (err {err:.1e})")


if __name__ == "__main__":
    main()
