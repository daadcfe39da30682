"""A public model zoo: attention models built by other libraries and by hand (random weights
from configs; nothing downloads), exported by torch's two ONNX exporters, run through lsa.
Every case states the right verdict; certified bounds are checked against float64 Jacobian
norms of the torch module. `python -m tests.zoo.table` writes docs/supported-models.md."""
