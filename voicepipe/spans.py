"""A span: one stretch of work a stage did for a turn, on the run's clock (ns)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from voicepipe.construct import built, copied


class Span(BaseModel):
    """One stretch of work a stage did for a turn, on the shared monotonic clock (ns).

    ``modelled`` spans are durations the models prescribed (the stage then slept until
    ``start_ns + dur_ns``); measured spans are what the stage observed.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    stage: str
    what: str
    start_ns: int
    dur_ns: int
    modelled: bool = True
    # a measured span's duration as a calibrated model predicted it (real endpoints with a profile):
    # counts towards the turn's predicted time instead of the measured duration
    predicted_ns: int | None = None

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.dur_ns


def modelled_span(stage: str, what: str, start_ns: int, dur_ns: int) -> Span:
    """``Span(stage=stage, what=what, start_ns=start_ns, dur_ns=dur_ns)`` — a modelled span — built without
    pydantic's validation when the instants are ints (the hot path: a span per spoken word and per reply
    chunk; about half the cost, timeit); anything else is validated, and refused, as the constructor would."""
    if (
        type(start_ns) is not int
        or type(dur_ns) is not int
        or type(stage) is not str
        or type(what) is not str
    ):
        return Span(stage=stage, what=what, start_ns=start_ns, dur_ns=dur_ns)
    return built(
        Span,
        {
            "stage": stage,
            "what": what,
            "start_ns": start_ns,
            "dur_ns": dur_ns,
            "modelled": True,
            "predicted_ns": None,
        },
        {"stage", "what", "start_ns", "dur_ns"},
    )


def shifted(spans: list[Span], shift_ns: int) -> list[Span]:
    """``spans`` moved ``shift_ns`` later (new spans, the fields copied as they are: an int shift keeps
    them valid); ``spans`` itself when there is nothing to move."""
    if not shift_ns or not spans:
        return spans
    out = []
    for s in spans:
        d = s.__dict__.copy()
        d["start_ns"] += shift_ns
        out.append(copied(s, d))
    return out
