"""Generated and hand-written Triton kernels, each beside the torch reference its tests use.

Tests run them on CPU under TRITON_INTERPRET=1 with odd sizes and poisoned outputs.
"""
