"""The options several commands share, defined once so their names, help and defaults cannot drift apart.

Each alias is an ``Annotated`` type a command's parameter uses as is (``wide: WideOpt = False``). The broker
and TLS options (``--broker``, ``--ca-file``, ``--cert-file``, ``--key-file``, ``--password-file``,
``--insecure``) are one block: a command takes a ``broker: BrokerOverrides`` parameter and is decorated with
:func:`broker_block`, which shows click the six options in that parameter's place and hands the command
one :class:`~voicepipe.config.BrokerOverrides`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from voicepipe.config import BrokerOverrides


def writable(path: Path | None) -> Path | None:
    """The callback of every option that names a file to write: its folder must exist and the path must not
    be a directory, checked before the command runs (a live run would otherwise measure for minutes and then
    fail to write). A bad path is click's one line and exit 2; existing non-regular files (``/dev/stdout``)
    are allowed."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory, not a file")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise typer.BadParameter(f"cannot write {path}: folder {folder} does not exist")
    return path


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


WideOpt = Annotated[
    bool,
    typer.Option("--wide/--fit", metavar="", help="Show every column, wider than the terminal if need be."),
]
FormatOpt = Annotated[
    OutputFormat,
    typer.Option("--format", help="stdout: tables, or JSON lines (one turn record each, nothing else)."),
]
OtelOpt = Annotated[
    Path | None, typer.Option(
        "--otel", metavar="FILE", help="Per-turn spans as OTLP/JSON traces.", callback=writable
    ),
]
OtlpOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp-endpoint",
        metavar="URL",
        envvar="OTEL_EXPORTER_OTLP_ENDPOINT",
        help="Push per-turn traces over OTLP/HTTP, e.g. http://localhost:4318 (env OTEL_EXPORTER_OTLP_ENDPOINT).",
    ),
]
RequireOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--require",
        metavar="NAME<=N",
        help="Exit 1 unless the turns meet it, e.g. 'p90<=800,within>=0.9' (p50 p90 p99 within ok tax_p50 "
        "talked_over uncertain; repeatable). within counts a modelled turn only when its 80 % range's slow end "
        "is inside the budget: an uncertain one is not a pass.",
    ),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", metavar="FILE", help="Pipeline config YAML.")
]
ConfigsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
        help="Pipeline config YAML (repeatable: one row per file; with --vary, several files are crossed "
        "with the varied values, one file is the base).",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="FIELD=VALUE",
        help="Override a config field: path.to.field=value (repeatable).",
    ),
]
VaryOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--vary",
        metavar="FIELD=V1,V2",
        help="Vary one config field: path.to.field=v1,v2,... (values parsed as YAML like --set; a value "
        "containing a comma is not supported). Give twice for a grid of two fields.",
    ),
]
SessionsOpt = Annotated[int, typer.Option("--sessions", "-n", min=1, help="Concurrent copies of each.")]
ReportOpt = Annotated[
    Path | None, typer.Option("--report", metavar="FILE", help="Self-contained HTML report.", callback=writable)
]
CsvOpt = Annotated[
    Path | None, typer.Option("--csv", metavar="FILE", help="Turn records as CSV.", callback=writable)
]
ScenariosArg = Annotated[
    list[str],
    typer.Argument(metavar="SCENARIO", help="Scenario files or shipped names (see `scenarios`)."),
]

# --- the broker/TLS block -------------------------------------------------------------------------------

_BROKER_PARAMS = (
    inspect.Parameter(
        "broker",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            str | None,
            typer.Option(
                "--broker",
                "-b",
                metavar="URL",
                help="mqtt://host:port or mqtts://host:port (default: env VOICEPIPE_BROKER, config, embedded); "
                "user name from env VOICEPIPE_BROKER_USERNAME, password from --password-file or env "
                "VOICEPIPE_BROKER_PASSWORD",
            ),
        ],
    ),
    inspect.Parameter(
        "ca_file",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option(
                "--ca-file", metavar="FILE", help="PEM CA file that signed the broker's certificate (mqtts://)."
            ),
        ],
    ),
    inspect.Parameter(
        "cert_file",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option("--cert-file", metavar="FILE", help="Client certificate (PEM) for mqtts://."),
        ],
    ),
    inspect.Parameter(
        "key_file",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option("--key-file", metavar="FILE", help="Unencrypted private key of --cert-file."),
        ],
    ),
    inspect.Parameter(
        "password_file",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option(
                "--password-file",
                metavar="FILE",
                help="File whose first line is the broker password (or env VOICEPIPE_BROKER_PASSWORD).",
            ),
        ],
    ),
    inspect.Parameter(
        "insecure",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[
            bool,
            typer.Option(
                "--insecure",
                metavar="",
                help="mqtts:// without verifying the broker's certificate (testing only).",
            ),
        ],
    ),
)
BROKER_OPTION_NAMES = tuple(p.name for p in _BROKER_PARAMS)


def broker_overrides(
    url: str | None,
    ca_file: Path | None = None,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    password_file: Path | None = None,
    insecure: bool = False,
) -> BrokerOverrides:
    """The block's values as the config loader takes them (paths as strings, None where not given)."""

    def s(p: Path | None) -> str | None:
        return str(p) if p is not None else None

    return BrokerOverrides(url, s(ca_file), s(cert_file), s(key_file), s(password_file), insecure)


R = TypeVar("R")


def broker_block(command: Callable[..., R]) -> Callable[..., R]:
    """Give ``command`` the broker/TLS options: its ``broker: BrokerOverrides`` parameter is shown to typer
    as the six options, in that parameter's place, and the command is called with them as one
    :class:`BrokerOverrides` (an option's value is never checked here; the config loader does that)."""
    sig = inspect.signature(command, eval_str=True)
    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.name == "broker"), None)
    if at is None or sig.parameters["broker"].annotation is not BrokerOverrides:
        raise TypeError(f"{command.__name__}: broker_block needs a parameter `broker: BrokerOverrides`")
    clash = set(BROKER_OPTION_NAMES[1:]) & set(sig.parameters)
    if clash:
        raise TypeError(f"{command.__name__}: parameters {sorted(clash)} clash with the broker block")
    shown = [*params[:at], *_BROKER_PARAMS, *params[at + 1 :]]
    # keyword-only so the defaults may sit anywhere; typer passes every parameter by name
    shown = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in shown]

    @functools.wraps(command)
    def with_broker(**kwargs: Any) -> R:
        opts = broker_overrides(*(kwargs.pop(n) for n in BROKER_OPTION_NAMES))
        return command(**kwargs, broker=opts)

    with_broker.__signature__ = sig.replace(parameters=shown)  # type: ignore[attr-defined]
    with_broker.__annotations__ = {p.name: p.annotation for p in shown}
    return with_broker
