"""8-bit residuals on a trained residual network: a small ResNet-style CNN trained here on scikit-learn's digits
keeps its held-out top-1 in an INT8 engine whose blocks add their residuals in 8 bits (builder/quantized_io.py)."""

import torch
from torch import nn

import kiln
from kiln.examples import digits


class ResidualDigits(nn.Module):
    """A stem, three residual blocks (3x3 then 1x1 convolution, the block input added before the last ReLU),
    2x2 max pooling and a classifier."""

    def __init__(self, c: int = 32):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 1)])
                                    for _ in range(3))
        self.fc = nn.Linear(c * 16, 10)

    def forward(self, image):
        x = torch.relu(self.stem(image))
        for conv3, conv1 in self.blocks:
            x = torch.relu(conv1(torch.relu(conv3(x))) + x)
        return self.fc(torch.flatten(torch.max_pool2d(x, 2), 1))


def test_int8_residual_blocks_keep_held_out_accuracy(tmp_path):
    x_tr, y_tr, x_te, y_te = digits.load_split(0)
    torch.manual_seed(0)
    net = digits.fit(ResidualDigits(), x_tr, y_tr, epochs=8, lr=3e-3)
    path = tmp_path / "resdigits.onnx"
    torch.onnx.export(net, (torch.zeros(2, 1, 8, 8),), str(path), input_names=["image"], output_names=["logits"],
                      dynamic_axes={"image": {0: "batch"}}, dynamo=False)
    prof = [kiln.Profile({"image": ((1, 1, 8, 8), (64, 1, 8, 8), (len(x_te), 1, 8, 8))})]
    calib = [{"image": x_tr[i:i + 32]} for i in range(0, 256, 32)]

    def top1(engine):
        logits = engine.create_execution_context().run({"image": x_te})["logits"]
        return 100.0 * float((logits.argmax(1) == y_te).mean())

    fp32 = kiln.build(str(path), kiln.BuildConfig(device="cpu", progress=False, profiles=prof))
    int8 = kiln.build(str(path), kiln.BuildConfig(device="cpu", progress=False, profiles=prof, int8=True,
                                                  calib=calib))
    adders = [n for n in int8.graph.nodes if n.op_type == "QConv" and len(n.inputs) > 8 and n.inputs[8]]
    assert len(adders) >= 2  # the blocks after the first add an 8-bit residual
    assert top1(fp32) >= 90.0
    assert top1(int8) >= top1(fp32) - 0.5, (top1(int8), top1(fp32))
