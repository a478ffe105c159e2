"""``voicepipe predict``: every turn's latency and breakdown from the live stages on virtual time.

No broker and no waiting: the pipeline's own code on an in-memory bus with zero hops. ``--format json``
prints one prediction per line; ``--require`` exits 1 when the predicted turns miss it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from voicepipe import gate
from voicepipe.cli.common import RecordSink, gate_exit, load_scenarios, out, user_errors, virtual_variants
from voicepipe.cli.options import (
    ConfigOpt,
    FormatOpt,
    OutputFormat,
    RequireOpt,
    ScenariosArg,
    SessionsOpt,
    SetOpt,
    WideOpt,
    writable,
)
from voicepipe.config import check_speech, load_config
from voicepipe.errors import UserError
from voicepipe.report.advice import advice, base_command, print_advice


def predict(
    scenario: ScenariosArg,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    sessions: SessionsOpt = 1,
    json_out: Annotated[
        Path | None, typer.Option("--json", metavar="FILE", help="One JSON prediction per line.", callback=writable)
    ] = None,
    fmt: FormatOpt = OutputFormat.table,
    wide: WideOpt = False,
    require: RequireOpt = None,
) -> None:
    """Predict every turn's latency and breakdown: the live stages on virtual time — no broker, no waiting.

    The pipeline's own code on an in-memory bus with zero hops: a live run's predicted_ms equals this for
    the same turn and seed (to within bus hops where timing overlaps or sessions queue on one device).
    """
    from voicepipe.predict import predict as predict_turns  # lazy: start-up time
    from voicepipe.report.table import print_predictions  # lazy: start-up time

    with user_errors():
        cfg = load_config(config, set_ or [])
        cfg = virtual_variants([("", cfg)], str(config or ""))[0][1]
        scs = load_scenarios(scenario)
        check_speech(cfg, scs)
        reqs = gate.parse(require)
        try:
            preds = predict_turns(cfg, scs, sessions)
        except ValueError as exc:
            raise UserError(f"{config or 'config'}{' (with --set)' if set_ else ''}", str(exc)) from None
    sink = RecordSink(json_out, stdout=fmt == OutputFormat.json)
    for p in preds:
        sink.write_raw(p.to_json())
    sink.close()
    records = [p.as_record() for p in preds]
    if fmt != OutputFormat.json:
        print_predictions(out, records, cfg.budget_ms, wide=wide)
        fix = advice(records, cfg, scenario, base_command("predict", scenario, config, set_ or []))
        if fix:
            print_advice(out, fix)
    gate_exit(reqs, records, sink.unwritten())
