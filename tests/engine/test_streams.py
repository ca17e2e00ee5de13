import torch
from torchvision.models.resnet import Bottleneck

import kiln
from kiln.engine import streams


class _Stage(torch.nn.Module):
    """A ResNet stage's first two blocks: the first has a downsample branch beside conv1-conv3."""

    def __init__(self):
        super().__init__()
        down = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 1, stride=2, bias=False), torch.nn.BatchNorm2d(16))
        self.blocks = torch.nn.Sequential(Bottleneck(8, 4, stride=2, downsample=down), Bottleneck(16, 4))

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
