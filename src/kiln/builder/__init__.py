"""One build: ONNX model in, Engine out (builder.py), through one ordered list of passes (pipeline.py):
layer pins, calibration, the graph rewrites (kiln.passes), placement, precision, 8-bit I/O, layout; then tactic
timing on the target (tactic_selection.py). Above the runtime (kiln.engine) and the passes; kiln.build
(kiln/build.py) runs the searches that compare several builds around it."""
