"""W8A16: int8 weights with float activations — the quantizer, the int8 linear per device
and the compressed-tensors checkpoint format."""
