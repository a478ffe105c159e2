"""Anchored predictions: a user's own measurement re-anchors the physics, the model gives the ratio only.

A profile written by ``voicepipe calibrate URL --against DEVICE/MODEL --anchor`` records what the server
ran on and the measured mean TTFT and time per output token of one load level
(:class:`~voicepipe.backends.profile.Anchor`). A prediction for a target configuration is then

    anchored = measured on the anchor × (model on the target / model on the anchor at the measured settings)

for TTFT and for the time per output token separately (:class:`Factors`: measured over modelled on the
anchor). The model on the anchor is re-run each time (:func:`anchor_prediction`), so both sides of the
ratio come from the same version of the physics.

On the serving engine (the agent's hardware backend with ``anchor:``, used by ``run``, ``predict`` and
``capacity``), :class:`AnchoredServer` applies the factors to every step. With ``t`` the TTFT factor, ``d``
the decode factor, ``M`` the modelled step of the batch (decoders and the prefill sharing it), ``D`` the
step of its decoders alone and ``P`` the step of its prefill alone (each 0 without decoders / prefill):

* ``t ≤ d``: step = t·M + (d − t)·D;   ``t > d``: step = d·M + (t − d)·P.

A decode-only step is d·D, a prefill alone t·P, and the stack's per-request cost is × t, so a request
alone on the device sees exactly the factors × the modelled TTFT and time per token (tested equal to
``hardware predict --anchor``, which runs this engine too). A mixed step charges the decoders about the
decode factor and the prefill about the TTFT factor; both forms grow with every argument (M, D and P do),
so a step never shortens when work is added (the engine relies on it; tested). Under load the split is a
modelling choice, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from voicepipe.backends.profile import Anchor, ProfileFile, parse_profile
from voicepipe.errors import UserError
from voicepipe.files import read_yaml_mapping
from voicepipe.hardware import catalog
from voicepipe.hardware.model import Prediction, Speculative, make_system, tokens_per_step
from voicepipe.hardware.model import predict as model_predict
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.system import System
from voicepipe.hardware.workload import steady, throughput


@dataclass(frozen=True)
class Factors:
    """Measured over modelled on the anchor: TTFT's and the time per output token's."""

    ttft: float
    step: float


def read_anchor(path: str | Path) -> Anchor:
    """The anchor of a profile file (UserError naming the file and field when it has none or is bad)."""
    where = str(path)
    p = Path(path)
    if not p.exists():
        raise UserError(where, "no such profile file")
    prof: ProfileFile = parse_profile(read_yaml_mapping(p), where)
    if prof.anchor is None:
        raise UserError(
            where,
            "anchor: missing (write one with `voicepipe calibrate URL --against DEVICE/MODEL --anchor`)",
        )
    return prof.anchor


def check_anchor(a: Anchor, where: str, model: str) -> None:
    """The anchor must be of the target's model (the ratio is of one model on two devices), and every
    configuration field must name what the catalog knows: a bad one is refused naming ``anchor.FIELD``."""
    checks = (("hardware", catalog.device), ("model", catalog.model), ("stack", catalog.stack),
              ("precision", catalog.check_precision), ("kv_precision", catalog.check_kv_precision))  # fmt: skip
    for field, check in checks:
        try:
            check(getattr(a, field))
        except ValueError as exc:
            raise UserError(where, f"anchor.{field}: {exc}") from None
    if a.model != model:
        raise UserError(
            where,
            f"anchor.model: {a.model!r} was measured, the prediction is for {model!r} (anchor on the same model)",
        )


def anchor_prediction(a: Anchor, where: str = "anchor") -> Prediction:
    """The model on the anchor's configuration at the measured settings (``concurrency`` clients each
    holding one request, its prompt and output lengths), as ``hardware predict`` runs it."""
    try:
        dev, mdl, stk = catalog.device(a.hardware), catalog.model(a.model), catalog.stack(a.stack)
        return model_predict(
            dev, mdl, precision=a.precision, batch=a.concurrency, prompt_tokens=a.prompt_tokens,
            output_tokens=a.output_tokens, tp=a.chips, kv_precision=a.kv_precision, stack=stk,
            timing="client",  # calibrate times the server as a client over HTTP
        )  # fmt: skip
    except ValueError as exc:  # DoesNotFit is a ValueError
        raise UserError(where, f"anchor: {exc}") from None


def factors(a: Anchor, where: str = "anchor") -> Factors:
    p = anchor_prediction(a, where)
    return Factors(ttft=a.ttft_ms / p.ttft_ms, step=a.tpot_ms / (1e3 / p.tokens_per_second))


def anchored(value: float, factor: float, rate: bool) -> float:
    """A modelled target value re-anchored: a time × the factor, a rate ÷ it."""
    return value / factor if rate else value * factor


def describe_anchor(a: Anchor, where: str, f: Factors) -> dict[str, Any]:
    """The anchor as JSON and tables state it."""
    return {
        "file": where, "hardware": a.hardware, "model": a.model, "precision": a.precision,
        "kv_precision": a.kv_precision, "stack": a.stack, "chips": a.chips, "concurrency": a.concurrency,
        "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens, "measured_ttft_ms": a.ttft_ms,
        "measured_tpot_ms": a.tpot_ms, "measured": a.measured,
        "factors": {"ttft": f.ttft, "tpot": f.step},  # measured / modelled on the anchor
    }  # fmt: skip


def anchor_line(a: Anchor, where: str) -> str:
    return (
        f"ANCHORED on a measurement ({where}): {a.hardware} x {a.chips} {a.model} {a.precision} with {a.stack}, "
        f"{a.concurrency} client(s), {a.prompt_tokens} in / {a.output_tokens} out: TTFT {a.ttft_ms:.1f} ms, "
        f"TPOT {a.tpot_ms:.2f} ms measured ({a.measured}); the model gives the ratio target / anchor only"
    )


def anchored_system(system: System, f: Factors) -> System:
    """``system`` with its stack's per-request costs (the engine's and the server's HTTP path around it) ×
    the TTFT factor (the stack charges them before a request reaches the device)."""
    stk = system.serving
    scaled = {"request_overhead_ms": stk.request_overhead_ms * f.ttft,
              "client_overhead_ms": stk.client_overhead_ms * f.ttft}  # fmt: skip
    return replace(system, stack=stk.model_copy(update=scaled))


class AnchoredServer(DeviceServer):
    """A :class:`DeviceServer` whose step times are re-anchored (module doc)."""

    def __init__(self, system: System, factors: Factors, **kw: Any) -> None:
        self.factors = factors
        super().__init__(anchored_system(system, factors), **kw)
        self._min_prefill_ns = self.step_ns(0, 0.0, 1, 0)  # the shortest prefill, re-anchored

    def step_ns(
        self, decoders: int, kv: float, prefill: int, cached: int, prompts: int = 1, span: float | None = None
    ) -> float:
        f = self.factors
        step = super().step_ns(decoders, kv, prefill, cached, prompts, span)
        if not decoders and not prefill:
            return step
        if f.ttft <= f.step:  # the decoders' own step carries the rest of the decode factor
            return f.ttft * step + (f.step - f.ttft) * (
                super().step_ns(decoders, kv, 0, 0) if decoders else 0.0
            )
        # the prefill's own step (alone on the device) carries the rest of the TTFT factor
        return f.step * step + (f.ttft - f.step) * (
            super().step_ns(0, 0.0, prefill, cached, prompts, span) if prefill else 0.0
        )


def anchored_prediction(p: Prediction, device: catalog.Device, model: catalog.ModelSpec, stack: catalog.Stack | None,
                        spec: Speculative | None, f: Factors) -> dict[str, float]:  # fmt: skip
    """``hardware predict``'s figures of ``p`` re-anchored: the same run (``batch`` clients each holding
    one request; the burst that fills the device, then a measured round) on an :class:`AnchoredServer` of
    the system ``p`` ran on. At batch 1 this is exactly factor × the modelled figure."""
    system = make_system(
        device, model, p.precision, tp=p.chips, seqs=p.batch if device.kind == "sram" else 1,
        context=p.prompt_tokens + p.output_tokens, kv_precision=p.kv_precision, stack=stack,
        timing="client" if p.ttft_timing == "client" else "engine",
    )  # fmt: skip
    server = AnchoredServer(system, f, max_batch=max(p.effective_batch, 1), spec=spec, prompt_cache=False)
    run = steady(server, p.batch, p.prompt_tokens, p.output_tokens, rounds=1 if p.batch == 1 else 2)
    return {
        "ttft_ms": run.ttft_s * 1e3,
        "step_ms": run.tpot_s * tokens_per_step(spec) * 1e3,
        "tokens_per_second": 1.0 / run.tpot_s,
        "aggregate_tokens_per_second": throughput(run, static=False),
    }
