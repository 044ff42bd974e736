"""Brook's inference engine.

``brook_engine.config`` is torch-free (the operator imports it); the offline API below loads
torch only when first used, so importing the package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from brook_engine.llm import LLM
    from brook_engine.outputs import CompletionOutput, RequestOutput
    from brook_engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "brook_engine.llm",
    "SamplingParams": "brook_engine.sampling_params",
    "RequestOutput": "brook_engine.outputs",
    "CompletionOutput": "brook_engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'brook_engine' has no attribute {name!r}")
