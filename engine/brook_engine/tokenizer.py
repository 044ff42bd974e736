"""The model's tokenizer (``tokenizer.json``), its special tokens, its chat template, and
incremental detokenization for streaming."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from brook_engine.config import ConfigError


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with the model's chat template."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content"))
    return None if value is None else str(value)


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{path} not found: the model folder needs a tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text("utf-8")) if config_path.exists() else {}
        template_file = folder / "chat_template.jinja"
        template = config.get("chat_template")
        if template_file.exists():
            template = template_file.read_text("utf-8")
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.token_id(self.bos_token)
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError("the model has no chat template; send a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None


@dataclass
class IncrementalDetokenizer:
    """Text of a growing token list, emitted piece by piece without splitting a multi-byte
    character (the prefix/read offsets technique)."""

    tokenizer: Tokenizer
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0

    def __post_init__(self) -> None:
        # Start from a few prompt tokens so the first output token decodes in context.
        self._ids = list(self.prompt_ids[-5:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append a token; returns the new text it completes (maybe empty)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self.skip_special_tokens)
        full_text = decode(self._ids[self._prefix :], self.skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new = full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += new
            return new
        return ""
