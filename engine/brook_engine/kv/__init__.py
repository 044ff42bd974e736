"""The paged KV cache: the cache tensors and their storage precision per layer, the block
manager with prefix sharing, calibration of the precision, and the cache's sizing."""
