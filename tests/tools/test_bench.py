"""kiln bench: trtexec-style timing on the CPU target (tiny iteration counts), peers, per-layer profile."""

import json

import pytest
import torch

from kiln.errors import ConfigError
from kiln.tools import bench as tool
from kiln.tools.bench import bench

from .conftest import cli


class TorchMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


def make_mlp():  # a MODULE:FACTORY for --torch
    return TorchMlp()


def test_summary_exports_and_layer_profile(mlp_files, capsys, tmp_path):
    rc = cli(tool, "bench", str(mlp_files.fp32), "--iterations", "5", "--warmUp", "1", "--dumpProfile",
             "--profileIterations", "2", "--exportTimes", str(tmp_path / "times.json"), "--exportProfile",
             str(tmp_path / "profile.json"), "--exportJson", str(tmp_path / "all.json"), "--shapes", "x:16x8")
    out = capsys.readouterr().out
    assert rc == 0
    for line in ("Throughput:", "Latency: min =", "median =", "percentile(99%)", "Enqueue Time:",
                 "GPU Compute Time: n/a (CPU target)", "H2D/D2H Latency: n/a", "=== Profile (2 iterations"):
        assert line in out
    assert "measured on CPU" in out  # says which device the figure comes from
    times = json.loads((tmp_path / "times.json").read_text())
    assert len(times) == 5 and {"startMs", "latencyMs", "enqueueMs"} <= set(times[0])
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof[0] == {"count": 2}
    assert [p["name"] for p in prof[1:]] == ["fc1 + fc1_bias + relu", "fc2 + fc2_bias"]
    assert sum(p["percentage"] for p in prof[1:]) == pytest.approx(100.0)
    assert all({"timeMs", "averageMs", "medianMs"} <= set(p) for p in prof[1:])
    everything = json.loads((tmp_path / "all.json").read_text())
    assert everything["shapes"] == {"x": [16, 8]} and everything["batch"] == 16
    assert everything["engine"]["iterations"] == 5


def test_eager_peer_and_a_failing_compile_mode_in_the_same_run(mlp_files, capsys):
    res = bench(mlp_files.engine16, iterations=3, warmup_ms=1, torch_module=TorchMlp(),
                baselines=["eager", "compile"], compile_modes=["no-such-mode"])
    names = [p.name for p in res.peers]
    assert names == ["PyTorch eager (float32)", "PyTorch eager (float16)", "torch.compile no-such-mode (float16)"]
    eager = res.peers[0]
    assert eager.ok and eager.speedup > 0 and eager.timings["iterations"] == 3
    failed = res.peers[-1]
    assert not failed.ok and "Unrecognized mode=no-such-mode" in failed.error
    tool.render(res, __import__("kiln.console", fromlist=["console"]).console())
    out = capsys.readouterr().out
    assert "torch.compile no-such-mode (float16)" in out and "FAILED: RuntimeError" in out


def test_peers_through_the_command_line_and_option_errors(mlp_files, capsys):
    factory = f"{__name__}:make_mlp"
    assert cli(tool, "bench", str(mlp_files.fp32), "--iterations", "2", "--warmUp", "1", "--baseline", "eager",
               "--torch", factory) == 0
    assert "PyTorch eager (float32)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--baseline needs the PyTorch model"):
        cli(tool, "bench", str(mlp_files.fp32), "--baseline", "eager")
    with pytest.raises(ConfigError, match=r"\['onnxruntime'\] unknown"):
        cli(tool, "bench", str(mlp_files.fp32), "--baseline", "onnxruntime", "--torch", factory)
    with pytest.raises(ConfigError, match="has no callable 'nope'"):
        cli(tool, "bench", str(mlp_files.fp32), "--baseline", "eager", "--torch", f"{__name__}:nope")
