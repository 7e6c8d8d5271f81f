"""The base of every config section (``schema.py``, ``backend_schema.py``): strict keys and numbers."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator


def _number_field(annotation: Any) -> bool:
    """Whether a field's type takes a number and not a boolean (``float``, ``int | None``, ...)."""
    return bool not in (args := get_args(annotation) or (annotation,)) and any(a in (int, float) for a in args)


class StrictModel(BaseModel):
    """A config section: no unknown keys, no .inf / .nan, no YAML true / false for a number (pydantic reads
    1 / 0: `ttft_ms: true`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(field.alias or name)
                if isinstance(value, bool) and _number_field(field.annotation):
                    raise ValueError(f"{field.alias or name}: a number is needed, not {str(value).lower()}")
        return data
