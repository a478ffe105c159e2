"""The HTML report's configuration section: what differs between the configurations, each one's full YAML folded.

:func:`config_diff` finds the dotted settings (:func:`flat_settings`) whose values differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from voicepipe.report.blocks import _section, _table
from voicepipe.report.svg import esc


def _config_dump(cfg: Mapping[str, Any]) -> str:
    try:
        return yaml.safe_dump(dict(cfg), sort_keys=False, allow_unicode=True, default_flow_style=False)
    except yaml.YAMLError:
        return json.dumps(cfg, indent=2, default=str)


def flat_settings(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested configuration as dotted keys → leaf values (``{"asr": {"model": "x"}}`` → ``asr.model``)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flat_settings(v, f"{key}."))
        else:
            out[key] = v
    return out


_ABSENT = object()


def _setting(v: Any) -> str:
    if v is _ABSENT:
        return '<span class="absent">not set</span>'
    return esc(v if isinstance(v, str) else json.dumps(v, default=str))


def _key(k: str) -> str:
    """A dotted setting that may break after a dot, never inside a name."""
    return "<code>" + ".<wbr>".join(esc(p) for p in k.split(".")) + "</code>"


def config_diff(configs: Sequence[Mapping[str, Any]]) -> tuple[list[str], int]:
    """The dotted settings whose values differ between ``configs`` (in first-seen order), and how many
    settings are the same in all of them."""
    flats = [flat_settings(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    differ = [
        k for k in keys if len({json.dumps(f[k], sort_keys=True, default=str) if k in f else None for f in flats}) > 1
    ]
    return differ, len(keys) - len(differ)


def _config(names: Sequence[str], labels: Sequence[str], configs: Mapping[str, Mapping[str, Any]]) -> str:
    recorded = [(n, configs[lb]) for n, lb in zip(names, labels, strict=True) if configs.get(lb)]
    missing = [n for n, lb in zip(names, labels, strict=True) if not configs.get(lb)]
    parts = []
    if len(recorded) > 1:
        differ, same = config_diff([c for _, c in recorded])
        flats = [flat_settings(c) for _, c in recorded]
        if differ:
            head = [("setting", False), *((n, False) for n, _ in recorded)]
            rows = [[_key(k), *(_setting(f.get(k, _ABSENT)) for f in flats)] for k in differ]
            parts.append(
                f'<p>{len(differ)} setting{"s" if len(differ) != 1 else ""} differ between the configurations; '
                f"the other {same} are the same in all of them.</p>"
            )
            parts.append(_table(head, rows).replace("<table>", '<table class="diff">', 1))
        else:
            parts.append(f"<p>The configurations are the same in all {same} settings.</p>")
    for name, cfg in recorded:
        what = f"full configuration: {name}" if len(names) > 1 else "full configuration (YAML)"
        parts.append(f"<details><summary>{esc(what)}</summary><pre>{esc(_config_dump(cfg))}</pre></details>")
    if missing:
        parts.append(f'<p class="note">not recorded: {esc(", ".join(missing))}</p>')
    return _section(
        "config",
        "Configuration",
        "What differs between the configurations (after overrides); each one's full configuration folds "
        "out below."
        if len(recorded) > 1
        else "The pipeline configuration the run used, after overrides (click to unfold).",
        "".join(parts),
    )
