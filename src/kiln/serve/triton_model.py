"""Triton Inference Server's Python-backend model for one Kiln engine.

`kiln export triton` copies this file to DIR/NAME/1/model.py beside the engine (DIR/NAME/1/model.kiln). Each
model instance loads the engine once, on its own GPU (KIND_GPU) or the CPU (KIND_CPU), through kiln.load, so
an engine built for another GPU, Kiln, torch or CUDA version, or a corrupted file, fails the model's load with
Kiln's message. The backend's Python must import kiln and torch: install Kiln into it, or put Kiln's
site-packages on the server's PYTHONPATH.

With max_batch_size > 0 Triton's dynamic batcher hands execute() several requests at once: those whose
non-batch dims agree run as one engine call (concatenated on axis 0) and their outputs are split back.
A merged batch below a profile's min batch is padded with copies of its last row, whose outputs are dropped.
"""

import json
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

try:
    import kiln
    from kiln.errors import KilnError, ShapeError
except ImportError as e:  # the backend's interpreter is not the one Kiln is installed in
    raise ImportError(f"the Triton Python backend cannot import kiln ({e}): install Kiln into the Python the "
                      "backend stub runs, or start tritonserver with PYTHONPATH naming Kiln's site-packages.") from e


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        engine_file = config["parameters"]["KILN_ENGINE"]["string_value"]
        path = Path(args["model_repository"]) / args["model_version"] / engine_file
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")
        self.engine = kiln.load(path, device=str(self.device))
        self.contexts = [self.engine.create_execution_context(profile=i)
                         for i in range(self.engine.num_optimization_profiles)]
        self.batching = config["max_batch_size"] > 0
        self.input_names = [v.name for v in self.engine.inputs]
        self.output_names = [v.name for v in self.engine.outputs]

    def execute(self, requests):
        feeds = []
        for request in requests:
            feeds.append({name: from_dlpack(pb_utils.get_input_tensor_by_name(request, name).to_dlpack())
                          for name in self.input_names})
        responses = [None] * len(requests)
        for group in self._groups(feeds):
            try:
                results = self._run([feeds[i] for i in group])
                for i, outs in zip(group, results):
                    responses[i] = pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor.from_dlpack(k, to_dlpack(outs[k].contiguous())) for k in self.output_names])
            except KilnError as e:
                for i in group:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
        return responses

    def _groups(self, feeds):
        """Indices of requests that can share one engine call (same non-batch dims)."""
        if not self.batching:
            return [[i] for i in range(len(feeds))]
        groups = {}
        for i, f in enumerate(feeds):
            groups.setdefault(tuple(tuple(x.shape[1:]) for x in f.values()), []).append(i)
        return list(groups.values())

    def _run(self, feeds):
        if self.batching:
            sizes = [next(iter(f.values())).shape[0] for f in feeds]
            merged = {k: torch.cat([f[k] for f in feeds]).to(self.device) for k in self.input_names}
        else:
            sizes, merged = None, {k: x.to(self.device) for k, x in feeds[0].items()}
        ctx, merged = self._context_for(merged)
        with torch.inference_mode():
            outs = ctx.run(merged)
        if sizes is None:
            return [outs]
        splits = {k: torch.split(v[:sum(sizes)], sizes) for k, v in outs.items()}  # drops padded rows
        return [{k: splits[k][i] for k in outs} for i in range(len(sizes))]

    def _context_for(self, feeds):
        """The first profile that accepts these shapes, padding the batch up to its min where batching."""
        error = None
        for ctx in self.contexts:
            padded = feeds
            if self.batching:
                batch = next(iter(feeds.values())).shape[0]
                need = self.engine.get_profile_shape(ctx.profile, self.input_names[0])[0][0] - batch
                if need > 0:
                    padded = {k: torch.cat([x, x[-1:].expand(need, *x.shape[1:])]) for k, x in feeds.items()}
            try:
                for k, x in padded.items():
                    ctx.check_shape(k, tuple(x.shape))
                return ctx, padded
            except ShapeError as e:
                error = error or e
        raise error
