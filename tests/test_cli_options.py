"""The shared CLI options: one broker/TLS block, the same in every command that takes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from voicepipe.cli import app
from voicepipe.cli.options import BROKER_OPTION_NAMES, SetOpt, broker_block
from voicepipe.config import BrokerOverrides

BLOCK = ["--broker", "--ca-file", "--cert-file", "--key-file", "--password-file", "--insecure"]


def _options(*path: str) -> list[tuple[tuple[str, ...], str | None, object]]:
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return [(tuple(p.opts), getattr(p, "help", None), p.default) for p in cmd.params]


def test_every_broker_command_shows_the_same_block_right_after_set() -> None:
    blocks = []
    for command in ("run", "compare", "stage"):
        opts = _options(command)
        names = [o[0][0] for o in opts]
        at = names.index("--broker")
        assert names[at - 1] == "--set"
        assert names[at : at + len(BLOCK)] == BLOCK
        blocks.append(opts[at : at + len(BLOCK)])
    assert blocks[0] == blocks[1] == blocks[2]


def test_commands_without_a_broker_have_no_block() -> None:
    for command in ("predict", "capacity"):
        names = {o for opts, _, _ in _options(command) for o in opts}
        assert not names & set(BLOCK)


def test_the_block_reaches_the_command_as_one_broker_overrides(tmp_path: Path) -> None:
    seen: list[tuple[BrokerOverrides, list[str] | None]] = []
    demo = typer.Typer()

    @demo.command()
    @broker_block
    def cmd(set_: SetOpt = None, broker: BrokerOverrides = BrokerOverrides()) -> None:
        seen.append((broker, set_))

    ca = tmp_path / "ca.pem"
    r = CliRunner().invoke(demo, ["-s", "a=1", "-b", "mqtts://h:8883", "--ca-file", str(ca), "--insecure"])
    assert r.exit_code == 0, r.output
    assert seen == [(BrokerOverrides("mqtts://h:8883", str(ca), None, None, None, True), ["a=1"])]
    seen.clear()
    assert CliRunner().invoke(demo, []).exit_code == 0
    assert seen == [(BrokerOverrides(), None)]


def test_the_block_needs_a_broker_overrides_parameter() -> None:
    def no_broker(set_: SetOpt = None) -> None: ...

    def clashing(broker: BrokerOverrides = BrokerOverrides(), insecure: bool = False) -> None: ...

    with pytest.raises(TypeError, match="broker: BrokerOverrides"):
        broker_block(no_broker)
    with pytest.raises(TypeError, match="clash"):
        broker_block(clashing)
    assert BROKER_OPTION_NAMES[0] == "broker"
