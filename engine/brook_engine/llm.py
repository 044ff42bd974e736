"""The offline API, in the shape vLLM users know:

llm = LLM(model="/models/SmolLM2-135M-Instruct", max_num_seqs=32)
outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
replies = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from brook_engine.config import ConfigError, EngineConfig, ModelConfig, parse_engine_config
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.outputs import RequestOutput
from brook_engine.sampling_params import SamplingParams

#: vLLM's option names, accepted so existing scripts port over.
_ALIASES = {
    "tensor_parallel_size": ("parallel", "tensor"),
    "pipeline_parallel_size": ("parallel", "pipeline"),
    "gpu_memory_utilization": ("kv_cache", "memory_fraction"),
    "enable_chunked_prefill": ("scheduler", "chunked_prefill"),
    "enable_prefix_caching": ("kv_cache", "prefix_sharing"),
}

Message = dict[str, Any]


def engine_config_from_options(
    model: str | None, options: dict[str, Any], base: EngineConfig | None = None
) -> EngineConfig:
    """``LLM(model, **options)`` → ``EngineConfig``. An option is a section (``kv_cache={...}``),
    a model field (``dtype``), or a field that exactly one section has (``max_num_seqs``).
    With ``base``, options override its values (sections merge field by field)."""
    # Field names, not the file's camelCase aliases: the options below are field names, and
    # a section holding both spellings of one field is refused as an unknown field.
    data: dict[str, Any] = (
        base.model_dump(exclude_unset=True, by_alias=False) if base is not None else {}
    )
    data.setdefault("model", {})
    if model is not None:
        data["model"]["uri"] = model
    sections = {
        name: field.annotation
        for name, field in EngineConfig.model_fields.items()
        if name not in ("model", "device")
    }
    for key, value in options.items():
        if key in ("device", *sections):
            if hasattr(value, "model_dump"):
                value = value.model_dump(exclude_unset=True, by_alias=False)
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        elif key in ModelConfig.model_fields:
            data["model"][key] = value
        elif key in _ALIASES:
            section, name = _ALIASES[key]
            if key == "enable_prefix_caching":
                value = {"enabled": value}
            data.setdefault(section, {})[name] = value
        else:
            owners = [s for s, cls in sections.items() if key in getattr(cls, "model_fields", {})]
            if len(owners) != 1:
                hint = "no section has it" if not owners else f"ambiguous between {owners}"
                raise ConfigError(
                    f"unknown option {key!r} ({hint}); pass a section instead, e.g. "
                    "kv_cache={'block_size': 32}"
                )
            data.setdefault(owners[0], {})[key] = value
    return parse_engine_config(data, source="LLM options")


class LLM:
    def __init__(self, model: str, *, progress: bool = True, **options: Any) -> None:
        self.engine = LLMEngine(engine_config_from_options(model, options), progress=progress)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the worker processes of a tensor- or pipeline-parallel engine (also done at
        interpreter exit); a no-op for a single-process one."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs come back in input order."""
        items: list[str | list[int]]
        if isinstance(prompts, str):
            items = [prompts]
        elif prompts and isinstance(prompts[0], int):
            items = [[int(t) for t in prompts]]  # type: ignore[arg-type]
        else:
            items = [p if isinstance(p, str) else list(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        return self._run(items, params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation or several, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        # The template writes any BOS itself, so no special tokens are added on top.
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(list(c)),  # type: ignore[arg-type]
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self, prompts: list[str | list[int]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        order = {request_id: i for i, request_id in enumerate(ids)}
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                self.engine.add_request(request_id, prompt, p)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finished: list[RequestOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[order[output.request_id]] = output
                        bar.update(1)
        return [o for o in finished if o is not None]
