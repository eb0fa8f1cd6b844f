import os

# Kernel tests run Triton's interpreter on CPU; this must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
