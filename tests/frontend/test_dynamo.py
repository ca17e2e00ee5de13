"""torch.compile(backend="kiln"): regions Kiln supports become engines, the rest runs in PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch

import kiln  # noqa: F401  (registers the backend when the package metadata does not)
from kiln.dynamo import OPTIONS, kiln_backend
from kiln.errors import ConfigError

# An operator Kiln knows nothing about, in the middle of the model: it must stay in PyTorch.
torch.library.define("kilntest::scale_columns", "(Tensor x) -> Tensor")


@torch.library.impl("kilntest::scale_columns", "default")
def _scale_columns(x):
    return x * torch.arange(1, x.shape[-1] + 1, dtype=x.dtype, device=x.device)


@torch.library.register_fake("kilntest::scale_columns")
def _scale_columns_fake(x):
    return torch.empty_like(x)


class BreakAndCustomOp(torch.nn.Module):
    """Linear+ReLU, a custom op, LayerNorm, a branch on a tensor's value and a print (two graph breaks)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        y = torch.relu(self.fc1(x))
        y = torch.ops.kilntest.scale_columns(y)
        y = self.norm(y)
        if y.sum() > 0:  # data-dependent Python branch: a graph break
            y = y * 2
        print("kiln test: graph break")
        return torch.sigmoid(self.fc2(y))


class Recorder:
    """kiln_backend itself, keeping what it did with each graph (the returned callable's .kiln)."""

    def __init__(self, **options):
        self.options, self.graphs = options, []

    def __call__(self, gm, example_inputs):
        fn = kiln_backend(gm, example_inputs, options=self.options)
        self.graphs.append(fn.kiln)
        return fn


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _kiln_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "backend='kiln'" in str(w.message)]


def test_graph_breaks_and_unsupported_op_match_eager(capsys):
    torch.manual_seed(0)
    model = BreakAndCustomOp().eval()
    x = torch.randn(2, 8)
    rec = Recorder(device="cpu")
    compiled = torch.compile(model, backend=rec)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = compiled(x), model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert "kiln test: graph break" in capsys.readouterr().out  # the print ran, in Python
    assert len(rec.graphs) >= 2  # dynamo split the forward at the break
    assert not _kiln_warnings(caught)
    engines = [r for g in rec.graphs for r in g.regions if r.engine is not None]
    # Linear+ReLU before the custom op and LayerNorm after it are separate engines.
    ops = [set(r.ops) for r in engines]
    assert any({"linear", "relu"} <= o for o in ops) and any("layer_norm" in o for o in ops)
    stays = {name: why for g in rec.graphs for name, why in g.in_pytorch.items()}
    custom = [why for why in stays.values() if "scale_columns" in why]
    assert custom and "no ONNX mapping" in custom[0]


def test_backend_by_name_with_options():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(inplace=True), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, 5)).eval()
    x = torch.randn(1, 3, 8, 8)
    compiled = torch.compile(model, backend="kiln", options={"precision": "fp32", "device": "cpu",
                                                             "workspace": 1 << 26, "optimization_level": 0})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)


def test_mark_dynamic_range_becomes_the_profile():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).eval()
    rec = Recorder(device="cpu")
    compiled = torch.compile(model, backend=rec)
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)  # compiled for x's marks
        for batch in (2, 16, 9):
            xb = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(xb), model(xb), atol=1e-5, rtol=1e-5)
    assert not _kiln_warnings(caught)  # every batch inside the profile: no rebuild
    (region,) = [r for g in rec.graphs for r in g.regions]
    lo, opt, hi = region.profile.shapes["in0"]
    assert (lo[0], opt[0], hi[0]) == (2, 4, 16)


def test_unbounded_size_rebuilds_with_a_wider_profile():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    compiled = torch.compile(model, backend="kiln", options={"device": "cpu"})
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (2, 3, 5):  # the second size makes dynamo recompile with a symbolic batch
            xb = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(xb), model(xb), atol=1e-5, rtol=1e-5)
    rebuilt = [m for m in _kiln_warnings(caught) if "outside its profile" in m]
    assert rebuilt and "rebuilding" in rebuilt[0]


def test_region_that_cannot_be_built_runs_in_pytorch_with_a_warning():
    # ONNX export turns a complex tensor into a real one with a trailing axis of 2: the engine's output
    # does not have PyTorch's layout, so the region stays in PyTorch and the warning names it.
    class Complex(torch.nn.Module):
        def forward(self, x):
            return (x.to(torch.complex64) * 2).real + 1

    model = Complex()
    x = torch.randn(3)
    compiled = torch.compile(model, backend="kiln", options={"device": "cpu"})
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), model(x))
    msgs = _kiln_warnings(caught)
    assert msgs and "kiln_region_" in msgs[0] and "runs in PyTorch" in msgs[0] and "complex64" in msgs[0]


def test_unknown_option_is_named():
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="kiln", options={"precison": "fp16"})
    with pytest.raises(Exception) as info:  # dynamo wraps a backend's error in BackendCompilerFailed
        compiled(torch.randn(2, 4))
    inner = getattr(info.value, "inner_exception", info.value)
    assert isinstance(inner, ConfigError)
    assert "precison" in str(inner) and all(k in str(inner) for k in OPTIONS)
    assert "did you mean 'precision'?" in str(inner)


def test_bad_option_values():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    for options, words in (({"precision": "int3"}, "precision='int3'"), ({"workspace": -1}, "workspace"),
                           ({"max_shapes": [1, 2]}, "max_shapes"), ({"device": "tpu"}, "device='tpu'"),
                           ({"optimization_level": 9}, "optimization_level=9 must be an integer 0..5"),
                           ({"timing_cache": 5}, "timing_cache=5 must be a file path"),
                           ("fp16", "options='fp16' must be a dict")):
        with pytest.raises(ConfigError, match=words):
            kiln_backend(gm, [torch.randn(2)], options=options)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet18", "squeezenet1_1", "encoder"])
def test_gpu_matches_inductor_in_the_same_run(name):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    if name == "encoder":  # the fused encoder fast path is one opaque op; the plain path has regions
        torch.backends.mha.set_fastpath_enabled(False)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        model, x = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.randn(2, 16, 64)
    else:
        model, x = getattr(torchvision.models, name)(weights=None), torch.randn(2, 3, 96, 96)
    model, x = model.eval().cuda(), x.cuda()
    rec = Recorder(precision="fp32")
    try:
        with torch.no_grad():
            eager = model(x)
            torch._dynamo.reset()
            ours = torch.compile(model, backend=rec)(x)
            torch._dynamo.reset()
            inductor = torch.compile(model, backend="inductor")(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    assert sum(g.engines for g in rec.graphs) >= 1
    scale = eager.float().pow(2).mean().sqrt().item()
    assert scale > 1e-3  # outputs of a usable size: the tolerance below is not vacuous
    assert (ours.float() - eager.float()).abs().max().item() <= 1e-2 * scale
    assert (ours.float() - inductor.float()).abs().max().item() <= 1e-2 * scale
