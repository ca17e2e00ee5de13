"""Triton Inference Server's Python-backend model for one Kiln engine.

`kiln export triton` copies this file to DIR/NAME/1/model.py beside the engine (DIR/NAME/1/model.kiln). Each
model instance loads the engine once, on its own GPU (KIND_GPU) or the CPU (KIND_CPU), through kiln.load, so
an engine built for another GPU, Kiln, torch or CUDA version, or a corrupted file, fails the model's load with
Kiln's message. The backend's Python must import kiln and torch: install Kiln into it, or put Kiln's
site-packages on the server's PYTHONPATH.

With max_batch_size > 0 Triton's dynamic batcher hands execute() several requests at once; kiln/serve/batching.py
runs them as few engine calls as their shapes allow.
"""

import json
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

try:
    from kiln.engine.serialize import load
    from kiln.serve.batching import BatchRunner
except ImportError as e:  # the backend's interpreter is not the one Kiln is installed in
    raise ImportError(f"the Triton Python backend cannot import kiln ({e}): install Kiln into the Python the "
                      "backend stub runs, or start tritonserver with PYTHONPATH naming Kiln's site-packages.") from e


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        engine_file = config["parameters"]["KILN_ENGINE"]["string_value"]
        path = Path(args["model_repository"]) / args["model_version"] / engine_file
        gpu = args["model_instance_kind"] == "GPU"
        device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")
        self.runner = BatchRunner(load(path, device=str(device)), device, config["max_batch_size"] > 0)

    def execute(self, requests):
        feeds = [{name: from_dlpack(pb_utils.get_input_tensor_by_name(request, name).to_dlpack())
                  for name in self.runner.input_names} for request in requests]
        responses = []
        for outs in self.runner.run_many(feeds):
            if isinstance(outs, Exception):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(outs))))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor.from_dlpack(k, to_dlpack(outs[k].contiguous())) for k in self.runner.output_names]))
        return responses
