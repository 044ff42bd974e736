"""The base every configuration section shares: frozen, strict about unknown keys, camelCase
on the wire (the CRD and the mounted file) and snake_case in Python."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ConfigError(ValueError):
    """A configuration that cannot run. The message names the field, the value and the fix."""


class Section(BaseModel):
    """Base of every configuration section.

    Both spellings are accepted on input (``maxModelLen`` from YAML, ``max_model_len`` from
    Python keyword arguments); output for files and the CRD is camelCase.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )
