"""Serving what Kiln builds: Triton Inference Server model repositories and the OpenAI-compatible LLM server."""
