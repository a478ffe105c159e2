"""A span: one stretch of work a stage did for a turn, on the run's clock (ns)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


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
