"""The building blocks of tensor and pipeline parallelism: who holds what (topology), the
process group and its communication (comm), the overlap monitor and micro-batch adaptation,
and the step plans rank 0 sends to the other ranks. Starting the ranks is ``core.ranks``."""
