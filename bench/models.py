"""The standard benchmark models (../shared/BENCHMARKS.md), random weights, nothing downloaded."""

from __future__ import annotations

import torch


def resnet50():
    import torchvision

    torch.manual_seed(0)  # the same random weights in every process (the ONNX export and --torch peers)
    model = torchvision.models.resnet50(weights=None).eval()
    return model, ("x",), lambda batch, g: {"x": torch.randn(batch, 3, 224, 224, generator=g)}


class _BertLastHidden(torch.nn.Module):
    """BERT-base returning last_hidden_state only (a plain tensor output exports cleanly)."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig()  # bert-base: 12 layers, hidden 768, 12 heads
        config._attn_implementation = "sdpa"
        self.bert = BertModel(config, add_pooling_layer=False).eval()

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def bert_base(seq: int = 128):
    torch.manual_seed(0)
    model = _BertLastHidden().eval()

    def inputs(batch, g):
        ids = torch.randint(0, 30522, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[:, seq * 3 // 4:] = 0  # padded tail, like real traffic
        return {"input_ids": ids, "attention_mask": mask}

    return model, ("input_ids", "attention_mask"), inputs


def vit_b16():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.vit_b_16(weights=None).eval()
    # torchvision zero-initializes the classifier, which makes every logit 0 and an accuracy check vacuous.
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    return model, ("x",), lambda batch, g: {"x": torch.randn(batch, 3, 224, 224, generator=g)}


MODELS = {"resnet50": resnet50, "bert-base": bert_base, "vit-b16": vit_b16}


def export_onnx(model, input_names, example: dict, max_batch: int, path) -> str:
    """A bench model saved as ONNX at `path`, every input's batch axis dynamic (1..max_batch); the example
    inputs have batch 2 (torch.export specializes a batch of 1)."""
    import onnx

    import kiln

    dim = torch.export.Dim("batch", min=1, max=max(2, max_batch))
    proto, _ = kiln.from_torch(model, tuple(example.values()), dynamic_shapes={k: {0: dim} for k in input_names},
                               opset=18)
    onnx.save(proto, str(path))
    return str(path)


def resnet50_module():
    """ResNet-50 alone, for `kiln bench --torch bench.models:resnet50_module` (same seed, same weights)."""
    return resnet50()[0]
