"""``voicepipe stage``: serve some stages of a run in this process; the rest, and the client, run elsewhere.

Needs a broker URL and the shared run token (:func:`voicepipe.stages.guard.require_shared_token`). It joins
the instance the run announces (:mod:`voicepipe.bus.instance`, verified with the token), serves it until it
is over, then waits for the next start of the same run id; stops on Ctrl-C or SIGTERM. A broker that cannot be reached is one error line, exit 2.
"""

from __future__ import annotations

from typing import Annotated

import typer

from voicepipe.cli.common import err, run_error, safe_url, stage_names, user_errors
from voicepipe.cli.options import ConfigOpt, SetOpt, broker_block
from voicepipe.config import BrokerOverrides, PipelineConfig, load_config
from voicepipe.errors import UserError, check_run_id
from voicepipe.modelled import require_keys
from voicepipe.stages.guard import require_shared_token
from voicepipe.workers import run_live_loop, serve_stages, until_signalled


@broker_block
def stage(
    names: Annotated[list[str], typer.Argument(help="Stages to serve: asr router agent cache council tts.")],
    run_id: Annotated[str, typer.Option("--run-id", help="The run to serve (same as `run --run-id`).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    broker: BrokerOverrides = BrokerOverrides(),
) -> None:
    """Serve some stages of a run in this process (the rest, and the client, run elsewhere).

    Same broker, run id and config as the `voicepipe run ... --external NAMES` that plays the scenario;
    all processes must share one host clock (CLOCK_MONOTONIC). Stops on Ctrl-C or SIGTERM.
    """
    with user_errors():
        cfg = load_config(config, set_ or [], broker)
        require_keys(cfg, str(config) if config else "")
        chosen = stage_names(names, "stage")
        check_run_id(run_id)
        if not cfg.broker.url:
            raise UserError("--broker", "stages in separate processes need a broker URL")
        require_shared_token("voicepipe stage")
    err.print(f"serving {', '.join(chosen)} for run {run_id} on {safe_url(cfg.broker.url)}", highlight=False)
    try:
        run_live_loop(until_signalled(_follow(cfg, chosen, run_id)))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        failure = run_error(cfg, exc)
        if failure is None:
            raise
        raise failure from None


async def _follow(cfg: PipelineConfig, names: list[str], run_id: str) -> None:
    """Serve each start of run ``run_id`` in turn (each with its own instance key)."""
    while True:
        await serve_stages(cfg, names, run_id)
