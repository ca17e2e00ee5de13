"""kiln.compile called the ways a user calls a module: positional, keyword, list feeds, CPU and CUDA tensors;
the result keeps the module's output structure (a transformers ModelOutput, a dict, a tuple)."""

import pytest
import torch

import kiln


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, bias):
        h = self.fc(x) + bias
        return {"logits": h, "probs": torch.softmax(h, dim=-1)}


class Pair(torch.nn.Module):
    def forward(self, x):
        return x * 2, x.sum(dim=-1)


def _same(a, b, tol=1e-5):
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def two_inputs_cpu():
    torch.manual_seed(0)
    net = TwoInputs().eval()
    fast = kiln.compile(net, inputs=[kiln.Input((1, 8), (2, 8), (4, 8))], kwarg_inputs={"bias": torch.zeros(4)},
                        device="cpu", progress=False)
    return net, fast


def test_positional_and_keyword_arguments_return_the_modules_dict(two_inputs_cpu):
    net, fast = two_inputs_cpu
    x, bias = torch.randn(3, 8), torch.randn(4)
    out = fast(x, bias=bias)
    ref = net(x, bias=bias)
    assert isinstance(out, dict) and list(out) == ["logits", "probs"]
    _same(out["logits"], ref["logits"])
    _same(out["probs"], ref["probs"])


def test_wrong_arguments_are_named(two_inputs_cpu):
    _, fast = two_inputs_cpu
    with pytest.raises(kiln.KilnError, match="missing: \\['bias'\\]"):
        fast(torch.randn(2, 8))
    with pytest.raises(kiln.KilnError, match="positional"):
        fast(torch.randn(2, 8), torch.randn(4))


def test_context_takes_list_tuple_tensor_and_dict_feeds(two_inputs_cpu):
    net, fast = two_inputs_cpu
    x, bias = torch.randn(2, 8), torch.randn(4)
    ref = net(x, bias=bias)["logits"]
    ctx = fast.engine.create_execution_context()
    names = [v.name for v in fast.engine.inputs]
    for feeds in ([x, bias], (x, bias), dict(zip(names, [x, bias]))):
        out = ctx.run(feeds)
        _same(list(out.values())[0], ref)
    with pytest.raises(kiln.KilnError, match="takes 2 inputs"):
        ctx.run(x)


def test_tuple_output_and_single_tensor_feed():
    fast = kiln.compile(Pair(), inputs=[torch.randn(2, 5)], device="cpu", progress=False)
    x = torch.randn(2, 5)
    doubled, total = fast(x)
    _same(doubled, x * 2)
    _same(total, x.sum(dim=-1))
    out = fast.engine.create_execution_context().run(x)  # one tensor for a one-input engine
    _same(list(out.values())[0], x * 2)


def test_hugging_face_model_returns_its_model_output():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertModel(cfg).eval()
    ids, mask = torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.int64)
    fast = kiln.compile(model, kwarg_inputs={"input_ids": ids, "attention_mask": mask}, device="cpu",
                        progress=False)
    mask[1, 5:] = 0
    out = fast(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask)
    assert type(out) is type(ref)
    _same(out.last_hidden_state, ref.last_hidden_state, 1e-4)
    _same(out.pooler_output, ref.pooler_output, 1e-4)


# --- on the GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_compile_with_cuda_tensors_positional_and_keyword():
    torch.manual_seed(0)
    net = TwoInputs().cuda().eval()
    x, bias = torch.randn(2, 8, device="cuda"), torch.randn(4, device="cuda")
    fast = kiln.compile(net, inputs=[kiln.Input((1, 8), (2, 8), (4, 8))], kwarg_inputs={"bias": bias},
                        device="cuda", progress=False)
    with torch.no_grad():
        ref = net(x, bias=bias)
    for _ in range(3):  # the first call captures a graph, later ones replay it (the checked-signature path)
        out = fast(x, bias=bias)
        assert out["logits"].is_cuda
        _same(out["logits"], ref["logits"])
    ctx = fast.engine.create_execution_context()
    for feeds in ([x, bias], (x, bias)):  # list feeds of device tensors: the UnboundLocalError's path
        for _ in range(2):
            _same(list(ctx.run(feeds).values())[0], ref["logits"])


@pytest.mark.gpu
def test_compile_cuda_engine_with_cpu_tensors_returns_cpu_tensors():
    fast = kiln.compile(Pair(), inputs=[torch.randn(2, 5)], device="cuda", progress=False)
    x = torch.randn(2, 5)
    doubled, total = fast(x)
    assert doubled.device.type == "cpu" and total.device.type == "cpu"
    _same(doubled, x * 2)


@pytest.mark.gpu
def test_compile_fp16_cnn_with_cuda_tensors():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 3, padding=1, groups=4), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(16, 10)).cuda().eval()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    fast = kiln.compile(net, inputs=[kiln.Input((1, 3, 32, 32), (4, 3, 32, 32), (8, 3, 32, 32))],
                        precision="fp16", device="cuda", progress=False)
    with torch.no_grad():
        ref = net(x)
    out = fast(x)
    assert out.is_cuda and out.dtype == torch.float32
    assert float((out - ref).norm() / ref.norm()) < 1e-2
