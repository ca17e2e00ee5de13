"""A signed .kiln LLM engine on 2 tensor-parallel ranks (real worker processes over gloo, on the CPU).

Rank 0 checks the engine (under --verify-key, its signature) when it loads it; each worker reads the file
again, and must find exactly the members rank 0 checked. An engine replaced or modified on disk in between is
refused by the worker before its weights are read, the error reaches rank 0, and no worker is left running.
"""

import os
import subprocess

import pytest

from kiln.errors import EngineFileError
from kiln.llm import engine_file as ef
from kiln.llm.engine import LLM, LLMEngine, SamplingParams, load_model
from tests.llm.tiny import make_tiny_llama

KEY = b"kiln-test-key-0123456789abcdef"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = "The quick brown fox"
KW = {"device": "cpu", "max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A tiny model's engine signed with KEY; the same engine with one weight changed, signed with KEY too
    (another engine the key holder built), and resealed without the key (what someone without it can write)."""
    root = tmp_path_factory.mktemp("tp-signed")
    signed = root / "signed.kiln"
    ef.build_llm_engine(make_tiny_llama(root / "m", heads=4, kv_heads=2), signed, dtype="fp32", device="cpu",
                        sign_key=KEY, log=lambda *a: None)
    members = ef._members(signed)
    w = bytearray(members[ef.WEIGHTS])
    w[-1] ^= 1
    members[ef.WEIGHTS] = bytes(w)
    other, resealed = root / "other.kiln", root / "resealed.kiln"
    for path, key in ((other, KEY), (resealed, None)):
        ef.serialize.save_members({**members, ef.CHECKSUMS: ef.checksums_of(members, key)}, path)
    return signed, other, resealed


def _no_worker_left():
    ps = subprocess.run(["ps", "-o", "args=", "--ppid", str(os.getpid())], check=True, capture_output=True,
                        text=True).stdout
    return not [line for line in ps.splitlines() if "kiln.llm.tp_workers" in line]


def test_signed_engine_runs_on_both_ranks(engines, tmp_path):
    signed, _, _ = engines
    path = tmp_path / "served.kiln"
    path.write_bytes(signed.read_bytes())
    one = LLM(str(path), **KW).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    ef.require_signed(path, KEY)
    tp = LLM(str(path), tensor_parallel_size=2, **KW)
    try:
        assert all(tp.llm_engine.workers.alive)
        assert tp.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == one
    finally:
        tp.shutdown()
    assert _no_worker_left()


def test_engine_swapped_after_rank_0_checked_it_is_refused_by_the_workers(engines, tmp_path):
    """Replaced by another engine signed with the same key: its signature holds, its members are not the ones
    rank 0 checked and loaded."""
    signed, other, _ = engines
    path = tmp_path / "served.kiln"
    path.write_bytes(signed.read_bytes())
    ef.require_signed(path, KEY)
    hf_config, tensors, tok, _ = load_model(path)  # rank 0's load, checked under the key
    path.write_bytes(other.read_bytes())
    with pytest.raises(EngineFileError, match=r"tensor-parallel rank 1 refused the engine rank 0 loaded: .*is not the "
                       r"engine that was checked before: weights.safetensors changed on disk since"):
        LLMEngine(hf_config, tensors, tok, tensor_parallel_size=2, source=str(path), **KW)
    assert _no_worker_left()


def test_a_read_pinned_to_checked_digests_refuses_any_other_file(engines, tmp_path):
    """What each worker's read does (in this process, without starting workers): the engine rank 0 checked
    loads; one resealed without the key after the check is refused before its weights are decoded."""
    signed, _, resealed = engines
    path = tmp_path / "pinned.kiln"
    path.write_bytes(signed.read_bytes())
    ef.read_llm_engine(path, verify_key=KEY)
    ef.expect_digests(path, ef.checked_digests(path))
    assert ef.read_llm_engine(path).manifest["format"] == ef.FORMAT
    path.write_bytes(resealed.read_bytes())
    with pytest.raises(EngineFileError, match="weights.safetensors changed on disk since"):
        ef.read_llm_engine(path)
