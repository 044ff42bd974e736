"""Tensor and pipeline parallelism: who holds what (topology), the process group and its
communication (group, comm), the overlap monitor, the step plans rank 0 sends to the others,
and the worker processes."""
