"""Synthetic inputs that look like data: token ids over the vocabulary, masks as masks, --valRange."""

import numpy as np
import pytest
import torch

import kiln
from kiln.engine.synthetic import describe, embedding_rows, parse_val_range
from kiln.errors import ConfigError

from .conftest import CPU
from .text_model import VOCAB, text_classifier

SEQ = 16


@pytest.fixture(scope="module")
def text_engine():
    prof = {"input_ids": ((1, SEQ), (8, SEQ), (64, SEQ)), "attention_mask": ((1, SEQ), (8, SEQ), (64, SEQ))}
    return kiln.build(text_classifier(), kiln.BuildConfig(profiles=[kiln.Profile(prof)], **CPU))


def test_token_ids_span_the_vocabulary(text_engine):
    ids = text_engine.random_inputs(profile=0, pick=2, seed=0)["input_ids"]  # 64 x 16 draws
    assert ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) <= VOCAB - 1
    assert int(ids.min()) < VOCAB // 20 and int(ids.max()) > VOCAB - VOCAB // 20
    assert len(torch.unique(ids)) > VOCAB // 2
    assert embedding_rows(text_engine.graph, "input_ids") == (VOCAB, "embeddings.word_embeddings.weight")


def test_attention_mask_is_a_mask(text_engine):
    mask = text_engine.random_inputs(profile=0, pick=2, seed=3)["attention_mask"].numpy()
    assert set(np.unique(mask)) <= {0, 1}
    lengths = mask.sum(1)
    assert lengths[0] == SEQ and (lengths < SEQ).any() and (lengths >= SEQ // 2).all()
    for row, n in zip(mask, lengths):  # ones, then zeros: padding only at the end
        assert (row[:n] == 1).all() and (row[n:] == 0).all()
    assert "mask" in describe(text_engine)["attention_mask"]


def test_val_range_spelling_and_use(text_engine):
    assert parse_val_range("input_ids:0,9 attention_mask:1,1") == {"input_ids": (0, 9), "attention_mask": (1, 1)}
    assert parse_val_range(["input_ids:[0,9],attention_mask:[1,1]"]) == {"input_ids": (0, 9),
                                                                          "attention_mask": (1, 1)}
    assert parse_val_range("-1.5,2e0") == {None: (-1.5, 2.0)}
    assert parse_val_range("input_1:0:-1,1") == {"input_1:0": (-1.0, 1.0)}  # TensorFlow-style names
    with pytest.raises(ConfigError, match="not inputs of the engine"):
        parse_val_range("ids:0,3", ["input_ids"])
    with pytest.raises(ConfigError, match="is empty"):
        parse_val_range("x:3,1")
    with pytest.raises(ConfigError, match="NAME:LO,HI"):
        parse_val_range("x:one,two")
    feeds = text_engine.random_inputs(pick=2, val_range=parse_val_range("input_ids:5,7 attention_mask:1,1"))
    assert set(torch.unique(feeds["input_ids"]).tolist()) == {5, 6, 7}  # integers: HI included
    assert bool((feeds["attention_mask"] == 1).all())


def test_an_integer_input_of_unknown_range_stays_binary(mlp_files):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Cast", ["n"], ["y"], to=TensorProto.FLOAT)], "cast",
                              [helper.make_tensor_value_info("n", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    engine = kiln.build(model, kiln.BuildConfig(profiles=[kiln.Profile({"n": ((1,), (64,), (64,))})], **CPU))
    assert set(engine.random_inputs()["n"].tolist()) == {0, 1}
    assert "--valRange" in describe(engine)["n"]
    x = mlp_files.engine32.random_inputs()["x"]
    assert x.dtype == torch.float32 and float(x.std()) > 0.5  # floats stay standard normal
