"""The engine's load-time plan: every per-op choice the engine makes on this machine, made in one step.

`make.make_plan(config, model, device, cache_dir)` returns one frozen `execution_plan.ExecutionPlan`: the
compute scheme (dtype, INT8 or not, which INT8 GEMM; `schemes.py`), compiled or torch attention
(`attention.py`), up to which batch size the INT8 products take the small-batch kernel (`small_batch.py`)
and the batch-invariance blocks of the exact mode (`invariance.py`). What is timed is timed by
`timing.py` and cached by `measure.py` (one file format, one lock, one rule for a bad file); the layer
products every measurement uses come from `shapes.py`. `smoothing.py` calibrates SmoothQuant scales at load.

Nothing is imported here, so importing one module of the package (weights.py reads shapes.py) loads no
other.
"""
