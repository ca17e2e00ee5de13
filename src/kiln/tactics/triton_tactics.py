"""Triton tactics (generated kernels from src/kiln/kernels/)."""
