"""``voicepipe schema scenario|config|messages``: the JSON Schema of each file or message voicepipe reads,
printed to stdout (generated from the pydantic models, so it cannot drift from what is accepted)."""

from __future__ import annotations

import json
import sys

import typer
from pydantic import BaseModel

from voicepipe.config import PipelineConfig
from voicepipe.messages import Envelope
from voicepipe.scenario import Scenario

app = typer.Typer(
    help="JSON Schemas of the files and messages voicepipe reads.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
)


def print_schema(model: type[BaseModel]) -> None:
    sys.stdout.write(json.dumps(model.model_json_schema(), indent=2) + "\n")


@app.command("scenario")
def schema_scenario() -> None:
    """JSON Schema of a scenario file (docs/scenarios.md explains every field)."""
    print_schema(Scenario)


@app.command("config")
def schema_config() -> None:
    """JSON Schema of a pipeline config file."""
    print_schema(PipelineConfig)


@app.command("messages")
def schema_messages() -> None:
    """JSON Schema of the bus envelope every MQTT message carries."""
    print_schema(Envelope)
