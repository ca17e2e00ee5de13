"""Shared engines for the tool tests: the tiny MLP (fp32, fp16) and the trained digits CNN (fp32, fp16).

Built once per test session on the CPU target; everything is real: real builds, real onnxruntime.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest

import kiln
from kiln.examples import digits as digits_example

from ..models import mlp

CPU = dict(device="cpu", progress=False)
MLP_PROFILE = {"x": ((1, 8), (4, 8), (16, 8))}
DIGITS_PROFILE = {"image": ((1, 1, 8, 8), (32, 1, 8, 8), (128, 1, 8, 8))}


def build(model, profile, **kw):
    return kiln.build(model, kiln.BuildConfig(profiles=[kiln.Profile(profile)], **CPU, **kw))


def cli(tool, *argv) -> int:
    """Run one tool's subcommand the way `kiln` will (the lead wires add_command into kiln.cli)."""
    p = argparse.ArgumentParser(prog="kiln")
    tool.add_command(p.add_subparsers(dest="command", required=True))
    args = p.parse_args([a for a in argv])
    return args.func(args)


@dataclass
class MlpFiles:
    onnx: Path
    fp32: Path
    fp16: Path
    engine32: object
    engine16: object


@pytest.fixture(scope="session")
def mlp_files(tmp_path_factory) -> MlpFiles:
    d = tmp_path_factory.mktemp("mlp")
    onnx.save(mlp(), d / "mlp.onnx")
    e32, e16 = build(mlp(), MLP_PROFILE), build(mlp(), MLP_PROFILE, fp16=True)
    e32.save(d / "mlp.kiln")
    e16.save(d / "mlp16.kiln")
    return MlpFiles(d / "mlp.onnx", d / "mlp.kiln", d / "mlp16.kiln", e32, e16)


@dataclass
class DigitsFiles:
    ex: digits_example.Digits
    fp32: Path
    fp16: Path


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> DigitsFiles:
    d = tmp_path_factory.mktemp("digits")
    ex = digits_example.prepare(d, seed=0, epochs=8, exporter="onnx")
    for name, kw in (("fp32", {}), ("fp16", {"fp16": True})):
        build(str(ex.onnx_path), DIGITS_PROFILE, **kw).save(d / f"digits_{name}.kiln")
    return DigitsFiles(ex, d / "digits_fp32.kiln", d / "digits_fp16.kiln")
