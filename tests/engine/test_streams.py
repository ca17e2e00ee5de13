import torch

import kiln
from kiln.engine import streams


class _Bottleneck(torch.nn.Module):
    """ResNet's bottleneck: 1x1, 3x3, 1x1 convolutions plus the residual, through a strided 1x1
    downsample convolution when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        mid = cout // 4
        self.conv1 = torch.nn.Conv2d(cin, mid, 1)
        self.conv2 = torch.nn.Conv2d(mid, mid, 3, stride=stride, padding=1)
        self.conv3 = torch.nn.Conv2d(mid, cout, 1)
        self.down = torch.nn.Conv2d(cin, cout, 1, stride=stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        return torch.relu(y + (self.down(x) if self.down is not None else x))


class _Stage(torch.nn.Module):
    """A ResNet stage's first two blocks: the first has a downsample branch beside conv1-conv3."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(_Bottleneck(8, 16, stride=2), _Bottleneck(16, 16))

    def forward(self, x):
        return self.blocks(x)


def _engine(module, shape):
    torch.manual_seed(0)
    proto, _ = kiln.from_torch(module.eval(), (torch.randn(*shape),), opset=18)
    name = proto.graph.input[0].name
    return kiln.build(proto, kiln.BuildConfig(device="cpu", progress=False, validate=False, shapes={name: shape}))


def test_the_downsample_branch_runs_beside_the_main_chain():
    engine = _engine(_Stage(), (1, 8, 16, 16))
    plan = streams.plan(engine.graph)
    assert len(plan) == 1  # the second block has no branch
    (i, branch), = plan.items()
    nodes = engine.graph.nodes
    assert nodes[i].op_type in ("Conv", "FusedConv") and nodes[i].attr("strides") == [2, 2]
    assert nodes[i].inputs[0] == engine.inputs[0].name and branch.after == ()  # it reads only the stage's input
    join = nodes[branch.join]
    assert join.op_type == "FusedConv" and nodes[i].outputs[0] in join.inputs  # conv3 + residual add + relu


def test_a_chain_has_no_branch():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert streams.plan(_engine(mlp, (2, 8)).graph) == {}
