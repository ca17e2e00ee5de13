"""from_torch: export with torch.onnx (dynamo), compare with onnxruntime, profile hints."""

import numpy as np
import onnx
import pytest
import torch
from torch.export import Dim

from kiln import Profile
from kiln.errors import ConfigError, UnsupportedError
from kiln.frontend import DynamicAxis, ProfileHints, check_model, from_torch
from kiln.frontend.torch_export import ExportFallbackWarning

ort = pytest.importorskip("onnxruntime")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, bias):
        return self.fc2(self.drop(torch.relu(self.fc1(x)))) + bias


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.head = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, image):
        return self.head(torch.flatten(self.features(image), 1))


class Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom inside forward")


def _ort(model: onnx.ModelProto, feeds: dict) -> list:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() for k, v in feeds.items()})


def _dims(vi):
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.fixture(scope="module")
def mlp_export():
    torch.manual_seed(0)
    module = MLP()
    module.train()  # from_torch exports in eval mode and restores this
    batch = Dim("batch", min=1, max=32)
    x, bias = torch.randn(3, 8), torch.randn(3, 4)
    model, hints = from_torch(module, (x, bias), dynamic_shapes={"x": {0: batch}, "bias": {0: batch}},
                              input_names=["features", "bias"], output_names=["logits"])
    return module, model, hints


def test_mlp_export_matches_torch_at_other_batch_sizes(mlp_export):
    module, model, _ = mlp_export
    assert module.training and module.drop.training  # training flags restored
    module.eval()
    for n in (1, 7, 32):
        x, bias = torch.randn(n, 8), torch.randn(n, 4)
        (got,) = _ort(model, {"features": x, "bias": bias})
        with torch.no_grad():
            want = module(x, bias).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    module.train()


def test_mlp_export_is_self_contained_and_symbolic(mlp_export):
    _, model, _ = mlp_export
    assert isinstance(model, onnx.ModelProto)
    assert [i.name for i in model.graph.input] == ["features", "bias"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert _dims(model.graph.input[0]) == ["batch", 8] and _dims(model.graph.output[0]) == ["batch", 4]
    assert all(t.data_location == onnx.TensorProto.DEFAULT and (t.raw_data or t.float_data)
               for t in model.graph.initializer)
    assert {o.domain: o.version for o in model.opset_import}[""] == 18
    onnx.checker.check_model(model, full_check=True)


def test_mlp_profile_hints(mlp_export):
    _, _, hints = mlp_export
    assert hints.shapes == {"features": (3, 8), "bias": (3, 4)}
    assert hints.axes == [DynamicAxis("features", 0, "batch", 1, 3, 32), DynamicAxis("bias", 0, "batch", 1, 3, 32)]
    assert hints.to_profile() == Profile({"features": ((1, 8), (3, 8), (32, 8)), "bias": ((1, 4), (3, 4), (32, 4))})


def test_exported_model_passes_kiln_check(mlp_export):
    _, model, _ = mlp_export
    r = check_model(model)
    assert r.checker.passed and r.shape_inference.passed and not r.missing_inputs
    assert [(i.name, i.dynamic_axes) for i in r.inputs] == [("features", [0]), ("bias", [0])]


def test_cnn_export_matches_torch():
    torch.manual_seed(0)
    module = SmallCNN().eval()
    module.features[1].running_mean.uniform_(-0.5, 0.5)  # make BatchNorm do something
    module.features[1].running_var.uniform_(0.5, 2.0)
    image = torch.randn(2, 3, 16, 16)
    model, hints = from_torch(module, image)  # one tensor works as example_inputs; static shapes
    assert not hints.dynamic and hints.to_profile() == Profile({"image": ((2, 3, 16, 16),) * 3})
    (got,) = _ort(model, {"image": image})
    with torch.no_grad():
        want = module(image).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_export_failure_names_module_and_error():
    with pytest.raises(UnsupportedError) as e:
        from_torch(Boom(), (torch.randn(2, 3),))
    msg = str(e.value)
    assert "Boom" in msg and "boom inside forward" in msg and "\x1b[" not in msg
    assert len(msg) < 1500


class ValueBranch(torch.nn.Module):
    """Python control flow on a tensor's value: torch.export cannot trace it; the TorchScript exporter traces the
    branch the example takes."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        if float(x.abs().sum()) > 0:
            return torch.relu(self.fc(x)) * 2
        return self.fc(x)


def test_a_module_torch_export_cannot_trace_goes_through_the_torchscript_exporter():
    torch.manual_seed(0)
    module = ValueBranch().eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    with pytest.warns(ExportFallbackWarning, match=r"ValueBranch: torch.export could not trace it \(torch.onnx."
                      r"export with dynamo=True, opset 18: .*\); exported with the TorchScript exporter"):
        model, hints = from_torch(module, (torch.randn(4, 6),), dynamic_shapes={"x": {0: batch}})
    assert hints.to_profile() == Profile({"x": ((1, 6), (4, 6), (16, 6))})
    x = torch.randn(9, 6)  # another batch size: the axis is dynamic
    (got,) = _ort(model, {"x": x})
    with torch.no_grad():
        np.testing.assert_allclose(got, module(x).numpy(), rtol=1e-5, atol=1e-6)


def test_bad_arguments_fail_before_exporting():
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        from_torch(lambda x: x, (torch.randn(2),))
    with pytest.raises(ConfigError, match="opset 16"):
        from_torch(torch.nn.ReLU(), (torch.randn(2),), opset=16)


def test_profile_needs_bounds():
    hints = ProfileHints(shapes={"x": (4, 8)}, axes=[DynamicAxis("x", 0, "batch", 1, 4, None)])
    with pytest.raises(ConfigError, match=r"input 'x' axis 0 \('batch'\).*no upper bound"):
        hints.to_profile()
    hints = ProfileHints(shapes={"x": (40, 8)}, axes=[DynamicAxis("x", 0, "batch", 1, 40, 32)])
    with pytest.raises(ConfigError, match=r"example size 40 is outside.*1\.\.32"):
        hints.to_profile()
    hints = ProfileHints(shapes={"x": None}, axes=[])
    with pytest.raises(ConfigError, match="input 'x'"):
        hints.to_profile()


def test_resnet18_export():  # ~10 s on 2 CPU cores once the exporter is warm (not marked slow)
    torchvision = pytest.importorskip("torchvision")
    module = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(2, 3, 64, 64)
    model, hints = from_torch(module, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
    assert hints.to_profile().shapes["x"] == ((1, 3, 64, 64), (2, 3, 64, 64), (8, 3, 64, 64))
    x4 = torch.randn(4, 3, 64, 64)
    (got,) = _ort(model, {"x": x4})
    with torch.no_grad():
        want = module(x4).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_build_from_export_with_hinted_profile(mlp_export):
    import kiln
    from kiln.ops import lookup

    module, model, hints = mlp_export
    ops = {n.op_type for n in model.graph.node}
    missing = sorted(op for op in ops if lookup(op) is None)
    if missing:
        pytest.skip(f"ops not registered yet: {', '.join(missing)}")
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[hints.to_profile()]))
    ctx = engine.create_execution_context()
    module.eval()
    x, bias = torch.randn(9, 8), torch.randn(9, 4)
    with torch.no_grad():
        want = module(x, bias)
    module.train()
    got = ctx.run({"features": x, "bias": bias})["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
