import pytest

from tests.llm.tiny import make_tiny_gqa9, make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Path of a tiny Llama HF directory (2 layers, 4 heads over 2 KV heads, vocab 384)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gqa9(tmp_path_factory):
    """Path of a tiny Llama with 9 query heads over 3 KV heads."""
    return make_tiny_gqa9(tmp_path_factory.mktemp("tiny-gqa9"))
