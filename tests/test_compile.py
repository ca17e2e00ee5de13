"""kiln.compile and kiln.from_torch: a torch module in, a callable engine out (CPU target)."""

import torch

import kiln


class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean(dim=(2, 3)))


def test_compile_behaves_like_the_module_across_the_profile():
    torch.manual_seed(0)
    net = SmallNet().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 1.5)
    fast = kiln.compile(net, inputs=[kiln.Input((1, 3, 16, 16), (4, 3, 16, 16), (8, 3, 16, 16))], device="cpu",
                        progress=False)
    assert fast.engine.num_optimization_profiles == 1
    fused = [n for n in fast.engine.graph.nodes if n.domain == "kiln"]
    assert fused, "conv + BN + ReLU should have fused"
    for batch in (1, 3, 8):
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), net(x), rtol=1e-4, atol=1e-4)
