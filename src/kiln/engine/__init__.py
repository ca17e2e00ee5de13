"""The runtime: an engine (engine.py), its file (serialize.py, manifest.py, signing.py), the interpreter that runs
its layers (interpreter.py), execution contexts (context.py, streams.py), profiles and input samples. It imports
nothing above the tactics; the builder (kiln.builder) sits on top of it."""
