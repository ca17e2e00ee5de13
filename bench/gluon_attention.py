"""Flash attention by TMA (kiln/kernels/tma_attention.py, Gluon) against attention.py's Triton kernel on the operands
a BERT-base engine hands them: q, k, v as head views of one fused QKV output ([B*S, 3*H*D], heads interleaved per
position), BERT's padding mask [B, 1, 1, S]; FP16 q/k/v with FP16 output (the FP16 engine) and FP8 codes with an
FP8 output (the FP8 engine). Each tile is checked against attention.reference, then timed (us,
kiln.tactics.timer.median_ms: CUDA-graph replays, as the builder times tactics).

    python bench/gluon_attention.py                    (GPU)
    python bench/gluon_attention.py --compile-only     (any machine: every tile compiled for sm_90, FP16 and FP8)
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels.tma_attention import CONFIGS, TmaFlashConfig, _tma_flash_kernel  # noqa: E402

# (name, batch, sequence, heads, head dim)
SHAPES = [("bert-base b32", 32, 128, 12, 64), ("bert-base b1", 1, 128, 12, 64), ("bert-large b32", 32, 384, 16, 64)]
# tiles timed beside the offered ones (CONFIGS)
EXTRA = [TmaFlashConfig(128, 128, 4, 2), TmaFlashConfig(64, 128, 4, 4), TmaFlashConfig(128, 64, 8, 2),
         TmaFlashConfig(64, 64, 4, 4), TmaFlashConfig(128, 128, 8, 2)]


OFFSETS_AND_STRIDES = "q_rb q_rh q_ch k_rb k_rh k_ch v_rb v_rh v_ch smb smh smm smn sob soh som".split()


def compile_only() -> int:
    """Each tile compiled for sm_90 for BERT-base's 128 keys, FP16 q/k/v and FP8 codes with an FP8 output; 1 if one
    failed."""
    from bench.sm90_compile import spilled_bytes

    failed = 0
    for cfg in [c for c, _ in CONFIGS] + EXTRA:
        for fp8 in (False, True):
            t, bits = ("fp8e4nv", 8) if fp8 else ("fp16", 16)
            d = 64

            def desc(rows):
                layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.float8e4nv if fp8 else gl.float16)
                return f"tensordesc<{t}[{rows},{d}],{layout!r}>"

            sig = {"q_desc": desc(cfg.block_m), "k_desc": desc(cfg.block_n), "v_desc": desc(cfg.block_n),
                   "o_ptr": "*fp8e4nv" if fp8 else "*fp16", "m_ptr": "*fp16", "ys_ptr": "*fp32", "qs_ptr": "*fp32",
                   **{p: "i32" for p in ("B", "H", "SQ", "SK")}, "qk_scale": "fp32",
                   **{p: "i32" for p in OFFSETS_AND_STRIDES},
                   **{p: "constexpr" for p in ("HAS_MASK", "MASK_ROW", "NAN_GUARD", "QUANT", "QKV_SCALED", "CDT",
                                               "KEY_BLOCKS", "num_warps")}}
            constexprs = dict(HAS_MASK=True, MASK_ROW=True, NAN_GUARD=False, QUANT="fp8" if fp8 else "",
                              QKV_SCALED=fp8, CDT=gl.float16, KEY_BLOCKS=cfg.key_blocks(128),
                              num_warps=cfg.num_warps)
            name = f"{cfg.name} {'FP8 codes, FP8 output' if fp8 else 'FP16'}"
            try:
                kernel = triton.compile(GluonASTSource(_tma_flash_kernel, sig, constexprs=constexprs),
                                        target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
            except Exception as e:
                print(f"Triton {triton.__version__}: {name} FAILED {type(e).__name__}: {str(e)[-1500:]}")
                failed = 1
                continue
            print(f"Triton {triton.__version__}: {name} compiles for sm_90; shared memory {kernel.metadata.shared} "
                  f"bytes; {spilled_bytes(kernel)} bytes spilled", flush=True)
    return failed


def main() -> int:
    if "--compile-only" in sys.argv:
        return compile_only()
    import torch

    from bench.attention_sweep import operands
    from kiln.kernels import attention, tma_attention
    from kiln.kernels.attention import FlashConfig
    from kiln.tactics.timer import median_ms

    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__)
    triton_tiles = [cfg for cfg, _ in attention.CONFIGS] + [FlashConfig(128, 32, 4, 2)]
    for name, b, s, h, d in SHAPES:
        q, k, v, mask = operands(b, s, h, d, True)
        scale = torch.tensor(max(t.abs().max().item() for t in (q, k, v)) / 448, device="cuda")
        q8, k8, v8 = ((t.float() / scale).to(attention.FP8) for t in (q, k, v))  # views of one [B, S, 3, H, D]
        y_scale = torch.tensor(0.01, device="cuda")
        cases = [("FP16", (q, k, v), {}, attention.reference(q, k, v, mask).float()),
                 ("FP8 codes, FP8 output", (q8, k8, v8), dict(qkv_scale=scale, y_scale=y_scale, qtype="fp8"),
                  attention.reference(q8, k8, v8, mask, qkv_scale=scale).float())]
        for label, args, kw, ref in cases:
            print(f"\n## {name} (sequence {s}, {h} heads of {d}), {label}: us (max |error| against the reference)",
                  flush=True)

            def error(out, kw=kw, ref=ref):
                got = out.float() * kw["y_scale"] if "y_scale" in kw else out.float()
                return (got - ref).abs().max().item()

            for cfg in triton_tiles:
                def run(cfg=cfg, args=args, kw=kw):
                    return attention.flash_attention(*args, mask, config=cfg, **kw)
                print(f"triton {cfg.name}: {1000 * median_ms(run, runs=20):.1f} ({error(run()):.1e})", flush=True)
            for cfg in [c for c, _ in tma_attention.CONFIGS] + EXTRA:
                if not tma_attention.supports(*args, mask, fp8="qkv_scale" in kw, config=cfg):
                    print(f"tma {cfg.name}: not taken")
                    continue

                def run(cfg=cfg, args=args, kw=kw):
                    return tma_attention.flash_attention(*args, mask, config=cfg, **kw)
                try:
                    err = error(run())
                    print(f"tma {cfg.name}: {1000 * median_ms(run, runs=20):.1f} ({err:.1e})", flush=True)
                except Exception as e:  # a tile that does not fit or compile here
                    print(f"tma {cfg.name}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
