"""Pydantic instances from values this process already holds validated, without validating them again.

For the bus's hot paths (every envelope, every span of a turn): :func:`built` is what ``model_construct``
does, without its per-field default handling; :func:`copied` is ``model_copy(update=...)`` without the deep
machinery. The caller vouches for the values (each already of its field's type and in range): what arrives
off the MQTT bus is still parsed and validated (``voicepipe.messages.parse``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

# BaseModel's slots, set directly by built()
_new = object.__new__
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def built(cls: type[M], fields: dict[str, Any], fields_set: set[str]) -> M:
    """An instance of pydantic model ``cls`` (no extra fields, no private attributes) holding ``fields`` —
    every field, with values this process already holds validated — without validating them again."""
    obj = _new(cls)
    _set_dict(obj, fields)
    _set_fields_set(obj, fields_set)
    _set_extra(obj, None)
    _set_private(obj, None)
    return obj


def copied(model: M, fields: dict[str, Any]) -> M:
    """A copy of ``model`` holding ``fields`` (its own, updated: ``model_copy(update=...)`` without the
    deep machinery; values must already be of the fields' types)."""
    return built(model.__class__, fields, set(model.__pydantic_fields_set__))
