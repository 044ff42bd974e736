"""Converters from other checkpoint formats to the Hugging Face folders the engine loads."""

from brook_engine.convert.gguf import (
    ConvertError,
    convert_gguf,
    find_packaged_smollm2,
    permute_qk,
    unpermute_qk,
)

__all__ = ["ConvertError", "convert_gguf", "find_packaged_smollm2", "permute_qk", "unpermute_qk"]
