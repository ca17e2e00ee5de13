import pytest

from tests.llm.tiny import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    """A tiny Llama HF directory (tests/llm/tiny.py), served by the server tests."""
    return make_tiny_llama(tmp_path_factory.mktemp("tinyllm"))
