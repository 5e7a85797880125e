"""Put first on PYTHONPATH, this hides the real ml_dtypes: an environment with numpy and torch
but without ml_dtypes (torch's bfloat16 tensors must not need it)."""

raise ImportError("ml_dtypes is hidden by tests/ranks/workers/no_ml_dtypes")
