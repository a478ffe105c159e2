"""Load the device, model and serving-stack catalogs (``data/*.yaml``) and look entries up by name.

The entry types, and the rule that every number carries its source, are :mod:`voicepipe.hardware.specs`'
(re-exported here). A user's own device (a YAML file with the fields of a catalog device) or model (a
Hugging Face ``config.json``) is accepted wherever a catalog name is: :func:`device` and :func:`model`
take a name or a path (see :mod:`voicepipe.hardware.byo`).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml

from voicepipe.errors import did_you_mean
from voicepipe.hardware.byo import load_device, load_hf_config
from voicepipe.hardware.specs import (
    HBM_GB,
    HEAD_FORMATS,
    KV_PRECISIONS,
    MAMF_SHARE_DEFAULT,
    PRECISIONS,
    STREAM_SHARE_DEFAULT,
    BlockFp8Gemm,
    Device,
    ModelSpec,
    PublicPrice,
    Quality,
    QualityOnly,
    Stack,
    kv_rereads,
)

__all__ = [
    "HBM_GB",
    "HEAD_FORMATS",
    "KV_PRECISIONS",
    "MAMF_SHARE_DEFAULT",
    "PRECISIONS",
    "STREAM_SHARE_DEFAULT",
    "BlockFp8Gemm",
    "Device",
    "ModelSpec",
    "PublicPrice",
    "Quality",
    "QualityOnly",
    "Stack",
    "kv_rereads",
]


def _read(name: str) -> dict:
    return yaml.safe_load(resources.files("voicepipe.hardware").joinpath("data", name).read_text())


@cache
def devices() -> dict[str, Device]:
    return {k: Device(key=k, **v) for k, v in _read("devices.yaml").items()}


@cache
def models() -> dict[str, ModelSpec]:
    return {k: ModelSpec(key=k, **v) for k, v in _read("models.yaml")["models"].items()}


@cache
def quality_only() -> dict[str, QualityOnly]:
    return {k: QualityOnly(**v) for k, v in (_read("models.yaml").get("quality_only") or {}).items()}


@cache
def stacks() -> dict[str, Stack]:
    return {k: Stack(key=k, **v) for k, v in _read("stacks.yaml")["stacks"].items()}


@cache
def default_stack_name() -> str:
    return str(_read("stacks.yaml")["default"])


def stack(name: str | None = None) -> Stack:
    """A serving-stack profile by name (None: the default one)."""
    key = name or default_stack_name()
    try:
        return stacks()[key]
    except KeyError:
        raise ValueError(f"unknown stack {key!r}{did_you_mean(key, stacks())}; known: {', '.join(sorted(stacks()))}") from None


def _is_path(name: str, suffixes: tuple[str, ...]) -> bool:
    return name.endswith(suffixes) or "/" in name or "\\" in name


def device(name: str) -> Device:
    """A catalog device by name, or a device YAML file (``*.yaml``/``*.yml`` or any path)."""
    if name in devices():
        return devices()[name]
    if _is_path(name, (".yaml", ".yml")):
        return load_device(name)
    raise ValueError(
        f"unknown hardware {name!r}{did_you_mean(name, devices())}; known: {', '.join(sorted(devices()))} "
        "or a device .yaml file"
    )


def model(name: str) -> ModelSpec:
    """A catalog model by name, or a Hugging Face ``config.json`` (any ``*.json`` or path)."""
    if name in models():
        return models()[name]
    if _is_path(name, (".json",)):
        return load_hf_config(name)
    raise ValueError(
        f"unknown model {name!r}{did_you_mean(name, models())}; known: {', '.join(sorted(models()))} "
        "or a config.json path"
    )


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    return precision


def check_kv_precision(precision: str) -> str:
    if precision not in KV_PRECISIONS:
        raise ValueError(f"unknown kv precision {precision!r}; use one of {', '.join(KV_PRECISIONS)}")
    return precision
