"""A small CNN trained on scikit-learn's digits (8x8 grey images, 10 classes), for held-out accuracy.

Trains in seconds with torch on the CPU, exports to ONNX, and writes the
held-out split as a .npz with the input under its binding name and `labels`:

    python -m kiln.examples.digits OUT_DIR
    kiln build --onnx=OUT_DIR/digits.onnx --fp16 --minShapes=image:1x1x8x8 --optShapes=image:32x1x8x8 \\
        --maxShapes=image:128x1x8x8 --saveEngine=OUT_DIR/digits_fp16.kiln
    kiln verify OUT_DIR/digits_fp16.kiln --data OUT_DIR/digits_test.npz --reference OUT_DIR/digits.onnx \\
        --budget top1=0.5

Files: digits.onnx (input `image` [batch, 1, 8, 8] float32, output `logits`
[batch, 10]), digits_test.npz (`image`, `labels`: the 20% held-out split),
digits_calib.npz (`image`: 256 training samples, for INT8 calibration).
The export goes through torch.onnx.export(dynamo=True); `exporter="onnx"`
writes the same graph directly with onnx.helper (no tracing: fast, for tests).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..fileio import atomic_write, atomic_write_bytes

INPUT = "image"
OUTPUT = "logits"
OPSET = 18
_MEAN, _STD = 4.88, 6.02  # pixel statistics of the digits set (values 0..16)


class DigitsCNN(nn.Module):
    """Conv(1->16)+ReLU, Conv(16->32)+ReLU, 2x2 max pool, Linear(512->10)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(image))
        x = torch.relu(self.conv2(x))
        x = torch.max_pool2d(x, 2)
        return self.fc(torch.flatten(x, 1))


def model(seed: int = 0) -> DigitsCNN:
    """The architecture with seeded random weights (a factory for `kiln bench --torch`)."""
    torch.manual_seed(seed)
    return DigitsCNN().eval()


def load_split(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): images [N, 1, 8, 8] float32 (standardized), labels int64."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = ((d.images.astype(np.float32) - _MEAN) / _STD)[:, None, :, :]
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return (np.ascontiguousarray(x_tr), y_tr, np.ascontiguousarray(x_te), y_te)


def train(seed: int = 0, epochs: int = 10, batch: int = 64, lr: float = 3e-3, split=None) -> DigitsCNN:
    """Train on the training split; a few seconds on a CPU."""
    x_tr, y_tr, _, _ = split or load_split(seed)
    return fit(model(seed), x_tr, y_tr, epochs, lr, batch, seed)


def fit(net: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, lr: float = 1e-3, batch: int = 64,
        seed: int = 0) -> nn.Module:
    """A plain classification loop (Adam, cross-entropy): training, and QAT fine-tuning of weights and
    learned scales. One thread: faster for nets this small."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = torch.optim.Adam(net.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed)
        xs, ys = torch.from_numpy(x), torch.from_numpy(y)
        net.train()
        for _ in range(epochs):
            order = torch.randperm(len(xs), generator=g)
            for i in range(0, len(xs), batch):
                idx = order[i:i + batch]
                loss = nn.functional.cross_entropy(net(xs[idx]), ys[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return net.eval()


def accuracy(net: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.inference_mode():
        pred = net(torch.from_numpy(x)).argmax(1).numpy()
    return 100.0 * float((pred == y).mean())


def onnx_model(net: DigitsCNN, exporter: str = "dynamo"):
    """The network as an onnx.ModelProto with a dynamic batch axis."""
    import onnx

    net = net.eval()
    if exporter == "dynamo":
        example = torch.zeros(2, 1, 8, 8)
        batch = torch.export.Dim("batch", min=1, max=4096)
        prog = torch.onnx.export(net, (example,), dynamo=True, input_names=[INPUT], output_names=[OUTPUT],
                                 dynamic_shapes=({0: batch},), opset_version=OPSET, verbose=False)
        return prog.model_proto
    if exporter != "onnx":
        raise ValueError(f"exporter must be 'dynamo' or 'onnx', not {exporter!r}")
    from onnx import TensorProto, helper, numpy_helper

    w = {k: v.detach().cpu().numpy() for k, v in net.state_dict().items()}
    inits = [numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in w.items()]
    nodes = [
        helper.make_node("Conv", [INPUT, "conv1.weight", "conv1.bias"], ["conv1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv1"], ["relu1"], name="relu1"),
        helper.make_node("Conv", ["relu1", "conv2.weight", "conv2.bias"], ["conv2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv2"], ["relu2"], name="relu2"),
        helper.make_node("MaxPool", ["relu2"], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], [OUTPUT], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "digits_cnn",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", 10])],
        inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kiln.examples.digits")
    onnx.checker.check_model(m)
    return m


@dataclass
class Digits:
    onnx_path: Path
    data_path: Path  # held-out split: `image`, `labels`
    calib_path: Path  # 256 training images: `image`
    module: DigitsCNN
    test_accuracy: float  # PyTorch's held-out top-1, in percent
    samples: int

    input_name: str = INPUT
    output_name: str = OUTPUT


def prepare(out_dir, seed: int = 0, epochs: int = 10, exporter: str = "dynamo") -> Digits:
    """Train, export and write the data files into out_dir (created if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split = load_split(seed)
    net = train(seed, epochs=epochs, split=split)
    x_tr, _, x_te, y_te = split
    proto = onnx_model(net, exporter)
    paths = Digits(out / "digits.onnx", out / "digits_test.npz", out / "digits_calib.npz", net,
                   accuracy(net, x_te, y_te), int(len(y_te)))
    atomic_write_bytes(paths.onnx_path, proto.SerializeToString())
    atomic_write(paths.data_path, lambda f: np.savez(f, **{INPUT: x_te, "labels": y_te}))
    rng = np.random.default_rng(seed)
    atomic_write(paths.calib_path, lambda f: np.savez(f, **{INPUT: x_tr[rng.choice(len(x_tr), 256, replace=False)]}))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.examples.digits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder for digits.onnx, digits_test.npz and digits_calib.npz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--exporter", choices=["dynamo", "onnx"], default="dynamo")
    a = p.parse_args(argv)
    d = prepare(a.out_dir, a.seed, a.epochs, a.exporter)
    print(f"trained: held-out top-1 {d.test_accuracy:.2f}% on {d.samples} samples (PyTorch)")
    print(f"wrote {d.onnx_path}, {d.data_path}, {d.calib_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
