"""``hardware sweep``'s rows: one modelled prediction per batch size, each independent of the others.

A row is :func:`voicepipe.hardware.model.predict` at one batch (exactly ``hardware predict --batch B``) plus
its cost per million output tokens and which serving mode that batch is. Pure: the same job and batch give
the same row anywhere, so :func:`sweep_rows` may hand the batches to any executor
(:mod:`voicepipe.parallel`: here by default, or a Ray cluster) and get the rows back in batch order. A
modelled row takes microseconds, so spreading them out pays only for very large grids; it is here so a
sweep can run where capacity's levels run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from voicepipe.hardware.catalog import Device, ModelSpec, Stack
from voicepipe.hardware.model import predict
from voicepipe.hardware.workload import Lengths
from voicepipe.parallel import Executor, LocalExecutor, Report


@dataclass(frozen=True)
class SweepJob:
    """Everything a sweep's row depends on except the batch size."""

    device: Device
    model: ModelSpec
    prompt_tokens: int
    output_tokens: int
    tp: int | None
    precision: str | None
    kv_precision: str | None
    stack: Stack | None
    fast_max_batch: int
    default_max_batch: int
    eager: bool = False  # no CUDA/HIP graphs (System.eager)
    scheduler_steps: int = 1  # multi-step scheduling (System.scheduler_steps)
    max_seqs: int | None = None  # the engine's cap on running sequences (System.max_seqs; None: the stack's)
    max_num_tokens: int | None = None  # the step token budget (System.max_num_tokens; None: the stack's)
    lengths: Lengths = "fixed"  # the clients' request lengths around the stated ones (workload.request_lengths)
    attention_dp: bool = False  # each chip the attention of its own sequences (System.attention_dp)

    def row(self, batch: int) -> dict[str, Any]:
        """The sweep's row at ``batch`` (raises ValueError, e.g. DoesNotFit, as ``predict`` does)."""
        p = predict(
            self.device, self.model, precision=self.precision, batch=batch, prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens, tp=self.tp, spec=None, kv_precision=self.kv_precision,
            stack=self.stack, eager=self.eager, scheduler_steps=self.scheduler_steps, max_seqs=self.max_seqs,
            max_num_tokens=self.max_num_tokens, lengths=self.lengths, attention_dp=self.attention_dp,
        )  # fmt: skip
        cost = p.chips * self.device.price_per_chip_hour / (p.aggregate_tokens_per_second * 3600) * 1e6
        modes = (("fast", batch == self.fast_max_batch), ("default", batch == self.default_max_batch))
        return {
            "batch": batch, "chips": p.chips, "fits": p.fits, "effective_batch": p.effective_batch,
            "step_ms": p.step_ms, "per_user_tps": p.tokens_per_second, "aggregate_tps": p.aggregate_tokens_per_second,
            "usd_per_mtok_out": cost, "ttft_ms": p.ttft_ms, "mode": ", ".join(m for m, hit in modes if hit),
        }  # fmt: skip


def _row(item: tuple[SweepJob, int], _report: Report) -> dict[str, Any]:
    job, batch = item
    return job.row(batch)


def sweep_rows(job: SweepJob, batches: Sequence[int], executor: Executor | None = None) -> list[dict[str, Any]]:
    """One row per batch, in ``batches`` order, on ``executor`` (default: here, one after another). A batch
    that fails raises :class:`voicepipe.parallel.ItemFailed` with its index."""
    return (executor or LocalExecutor(1)).map(_row, [(job, b) for b in batches])
