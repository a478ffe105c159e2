"""Hardware-modelled LLM backends: ``make_hardware_backend("cerebras-wse3/llama-3.1-8b")`` or a dict.

Dict keys: ``hardware``, ``model`` (required: catalog names, or a device YAML file and a Hugging Face
``config.json`` path, see :mod:`voicepipe.hardware.byo`); ``precision``, ``kv_precision`` (default: the
model's), ``stack`` (serving-stack profile, default vllm), ``tp``, ``max_batch`` (the engine's cap on
sequences running at once: vLLM ``--max-num-seqs``, TensorRT-LLM ``--max_batch_size``; ``System.max_seqs``,
the same setting as ``hardware predict --max-seqs``; default 64, fewer where their KV does not fit), ``context`` (tokens
per sequence the system is sized for, default 4096), ``speculative: {alpha, gamma, draft_cost}``,
``fast`` (same model at a small max batch, priced accordingly), ``prompt_cache`` (honour the request's
``cached_prompt_tokens``; default true), ``eager`` (no CUDA/HIP graphs: vLLM ``--enforce-eager``,
SGLang ``--disable-cuda-graph``; default false), ``scheduler_steps`` (vLLM V0 multi-step scheduling,
``--num-scheduler-steps``; default 1), ``max_num_tokens`` (the engine's step token budget: vLLM
``--max-num-batched-tokens``, TensorRT-LLM ``--max_num_tokens``, SGLang ``--chunked-prefill-size``; as
``hardware predict --max-num-tokens``; default the stack's), ``attention_dp`` (each chip runs the attention of
its own share of the sequences: SGLang ``--enable-dp-attention``, TensorRT-LLM ``enable_attention_dp``, vLLM
``--data-parallel-size``; two chips or more; default false), ``anchor`` (a profile written by ``calibrate --anchor``: the
device's step times re-anchored on that measurement, :mod:`voicepipe.backends.anchor`; precision, KV
precision and stack default to the anchor's).

``predict`` is the idle device: the serving engine's run of the request alone
(:func:`voicepipe.hardware.workload.alone`: ``ttft = stack request cost + t_step(prefill of prompt − cached)``,
that forward pass emitting token 0 — over several steps where a chunking stack splits a prompt longer than
its step budget; ``tpot = t_step(1 sequence at prompt + output/2 context) / E``). ``start`` runs the request on the
backend's one shared :class:`~voicepipe.hardware.serving.DeviceServer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from voicepipe.backends.anchor import (
    AnchoredServer,
    Factors,
    check_anchor,
    describe_anchor,
    factors,
    read_anchor,
)
from voicepipe.backends.base import LLMRequest, Prices, Timing
from voicepipe.backends.profile import Anchor
from voicepipe.errors import UserError
from voicepipe.hardware.catalog import (
    Device,
    ModelSpec,
    check_kv_precision,
    check_precision,
    default_stack_name,
    device,
    model,
    stack,
)
from voicepipe.hardware.model import (
    DoesNotFit,
    Speculative,
    System,
    decode_step_s,
    default_kv_precision,
    make_system,
    max_sequences,
    mean_context,
    prefill_s,
    tokens_per_step,
    tp_options,
)
from voicepipe.hardware.quality import quality_of
from voicepipe.hardware.serving import DeviceServer, DeviceStream
from voicepipe.hardware.workload import alone

DEFAULT_MAX_BATCH = 64  # the deployment's --max-num-seqs: 64, latency-oriented (vLLM's default is 256/1024)
FAST_MAX_BATCH = 4  # "fast mode": the same model on the same chips, at most 4 sequences per step
DEFAULT_CONTEXT = 4096
SRAM_MIN_BATCH = 8  # SRAM systems get chips for at least 8 sequences of KV
PRICE_PROMPT_TOKENS = 4096  # prefill chunk used to price input tokens
SPEC_KEYS = {
    "hardware",
    "model",
    "precision",
    "kv_precision",
    "stack",
    "tp",
    "max_batch",
    "context",
    "speculative",
    "fast",
    "prompt_cache",
    "eager",
    "scheduler_steps",
    "max_num_tokens",
    "attention_dp",
    "anchor",
}


@dataclass(frozen=True)
class Deployment:
    """A sized serving configuration (what a backend is built from; also used by the CLI sweep)."""

    system: System
    max_batch: int
    context: int
    spec: Speculative | None = None
    fast: bool = False
    prompt_cache: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)
    sized_batch: int = 0  # the max batch this deployment would run without fast mode (0: max_batch)


def parse_spec(spec: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(spec, str):
        hw, sep, mdl = spec.partition("/")
        if not sep or not hw or not mdl:
            raise ValueError(f"hardware backend {spec!r} must look like DEVICE/MODEL")
        return {"hardware": hw.strip(), "model": mdl.strip()}
    if not isinstance(spec, dict):
        raise ValueError(
            f"hardware backend spec must be DEVICE/MODEL or a mapping, got {type(spec).__name__}"
        )
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(
            f"unknown hardware backend field {unknown[0]!r}; allowed: {', '.join(sorted(SPEC_KEYS))}"
        )
    for key in ("hardware", "model"):
        if not spec.get(key):
            raise ValueError(f"hardware backend needs a {key!r} field")
    return dict(spec)


def _int(cfg: dict[str, Any], key: str, lo: int = 1) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{key} must be an integer >= {lo}, got {value!r}")
    return value


def _speculative(value: Any) -> Speculative | None:
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise ValueError("speculative must be a mapping {alpha, gamma, draft_cost}")
    extra = sorted(set(value) - {"alpha", "gamma", "draft_cost"})
    if extra:
        raise ValueError(f"unknown speculative field {extra[0]!r}")
    try:
        return Speculative(float(value["alpha"]), int(value["gamma"]), float(value.get("draft_cost", 0.05)))
    except KeyError as exc:
        raise ValueError(f"speculative needs {exc.args[0]!r}") from None


def deploy(cfg: dict[str, Any]) -> Deployment:
    """Size the system for a parsed spec (raises ValueError / DoesNotFit with a one-line reason)."""
    dev: Device = device(str(cfg["hardware"]))
    mdl: ModelSpec = model(str(cfg["model"]))
    prec = check_precision(str(cfg.get("precision") or mdl.default_precision))
    kv = check_kv_precision(str(cfg["kv_precision"])) if cfg.get("kv_precision") else None
    stk = stack(str(cfg["stack"])) if cfg.get("stack") else None
    tp = _int(cfg, "tp")
    asked_batch = _int(cfg, "max_batch")
    context = _int(cfg, "context") or DEFAULT_CONTEXT
    fast = bool(cfg.get("fast", False))
    adp = cfg.get("attention_dp", False)
    if not isinstance(adp, bool):
        raise ValueError(f"attention_dp must be true or false, got {adp!r}")
    notes: list[str] = []
    if asked_batch is not None:
        system = make_system(
            dev, mdl, prec, tp=tp, seqs=asked_batch, context=context, kv_precision=kv, stack=stk,
            max_seqs=asked_batch, attention_dp=adp,
        )
        max_batch = asked_batch
    elif dev.kind == "sram":
        one = make_system(dev, mdl, prec, seqs=1, context=context, kv_precision=kv, stack=stk, attention_dp=adp)
        leftover = max_sequences(one, context)
        max_batch = max(SRAM_MIN_BATCH, min(DEFAULT_MAX_BATCH, leftover))
        system = make_system(dev, mdl, prec, seqs=max_batch, context=context, kv_precision=kv, stack=stk)
        notes.append(f"max_batch {max_batch}: KV room left beside the weights (at least {SRAM_MIN_BATCH})")
    else:
        try:
            system = make_system(
                dev, mdl, prec, tp=tp, seqs=DEFAULT_MAX_BATCH, context=context, kv_precision=kv, stack=stk,
                max_seqs=DEFAULT_MAX_BATCH, attention_dp=adp,
            )
            max_batch = DEFAULT_MAX_BATCH
        except DoesNotFit:
            system = _widest_useful(make_system(dev, mdl, prec, tp=(2 if adp else 1) if tp is None else tp, seqs=0,
                                                context=context, kv_precision=kv, stack=stk, strict=False,
                                                max_seqs=DEFAULT_MAX_BATCH, attention_dp=adp),
                                    tp, context)  # fmt: skip
            max_batch = _most_that_fit(system, context)
            notes.append(f"max_batch {max_batch}: KV memory left at tp {system.chips}")
    sized_batch = max_batch
    if fast:
        max_batch = min(max_batch, FAST_MAX_BATCH)
    eager = cfg.get("eager", False)
    if not isinstance(eager, bool):
        raise ValueError(f"eager must be true or false, got {eager!r}")
    # run settings of the served system (System.eager, System.scheduler_steps; System.max_seqs: max_batch is
    # the engine's cap on running sequences, so the shared DeviceServer and every predict honour the same one)
    system = replace(system, eager=eager, scheduler_steps=_int(cfg, "scheduler_steps") or 1, max_seqs=max_batch,
                     max_num_tokens=_int(cfg, "max_num_tokens"))  # fmt: skip
    return Deployment(
        system=system,
        max_batch=max_batch,
        context=context,
        spec=_speculative(cfg.get("speculative")),
        fast=fast,
        prompt_cache=bool(cfg.get("prompt_cache", True)),
        notes=tuple(notes),
        sized_batch=sized_batch,
    )


def _most_that_fit(system: System, context: int) -> int:
    """The most sequences of ``context`` tokens that fit when they are also the engine's cap (``max_seqs``): a
    smaller cap shrinks the engine's reserve (vLLM profiles its sampler over ``max_num_seqs`` slots,
    :func:`~voicepipe.hardware.sizing.profile_shape`), so the count is the largest ``n`` whose own system
    holds ``n`` (at least what fits under the stack's default cap; below DEFAULT_MAX_BATCH, which did not fit)."""
    lo, hi = 1, DEFAULT_MAX_BATCH - 1  # what fits only grows as the cap falls: bisect for the fixed point
    if max_sequences(replace(system, max_seqs=lo), context) < lo:
        return max_sequences(system, context)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if max_sequences(replace(system, max_seqs=mid), context) >= mid:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _widest_useful(probe: System, tp: int | None, context: int) -> System:
    """Fallback when 64 sequences don't fit: the first TP width holding 8 sequences, else the widest."""
    widths = [tp] if tp is not None else [w for w in tp_options(probe.device) if w >= (2 if probe.attention_dp else 1)]
    last: System | None = None
    for width in widths:
        system = replace(probe, chips=width)
        n = max_sequences(system, context)
        if n >= 8:
            return system
        if n >= 1:
            last = system
    if last is None:  # raises DoesNotFit
        return make_system(
            probe.device, probe.model, probe.precision, tp=tp, seqs=1, context=context,
            kv_precision=probe.kv_precision, stack=probe.stack, attention_dp=probe.attention_dp,
        )  # fmt: skip
    return last


def aggregate_tokens_per_s(dep: Deployment, batch: int) -> float:
    """Modelled output tok/s of the whole system with ``batch`` sequences at half the sized context."""
    step = float(decode_step_s(dep.system, batch, dep.context / 2, dep.spec))
    return batch * tokens_per_step(dep.spec) / step


def modelled_prices(dep: Deployment) -> Prices:
    """$/Mtok from the chips' hourly price and modelled throughput (output at max batch; input prefill)."""
    sys_ = dep.system
    per_hour = sys_.chips * sys_.device.price_per_chip_hour
    out_tps = aggregate_tokens_per_s(dep, dep.max_batch)
    in_tps = PRICE_PROMPT_TOKENS / float(prefill_s(sys_, PRICE_PROMPT_TOKENS))
    return Prices(
        input_per_mtok=per_hour / (in_tps * 3600) * 1e6,
        output_per_mtok=per_hour / (out_tps * 3600) * 1e6,
        source=(
            f"MODELLED: {sys_.chips} x {sys_.device.key} at ${sys_.device.price_per_chip_hour}/chip-h "
            f"({sys_.device.sources['price_per_chip_hour']}) / modelled throughput at max_batch {dep.max_batch}"
        ),
    )


def prices_for(dep: Deployment) -> Prices:
    """The public per-token price for this device+model if one exists (fast mode scaled by the modelled
    cost ratio), else :func:`modelled_prices`."""
    sys_ = dep.system
    public = sys_.model.prices.get(sys_.device.key)
    if public is None or sys_.precision != sys_.model.default_precision:
        return modelled_prices(dep)
    if not dep.fast:
        return Prices(public.input, public.output, public.source)
    # the same deployment (chips, stack, KV format, context, run settings) at the batch it would run without
    # fast mode, so the ratio is the batch's alone
    sized = dep.sized_batch or dep.max_batch
    normal = replace(dep, fast=False, max_batch=sized, system=replace(sys_, max_seqs=sized))
    ratio = modelled_prices(dep).output_per_mtok / modelled_prices(normal).output_per_mtok
    return Prices(
        public.input * ratio,
        public.output * ratio,
        f"{public.source} x {ratio:.2f} (MODELLED fast-mode cost ratio: max_batch {dep.max_batch} "
        f"vs {normal.max_batch})",
    )


class HardwareBackend:
    """A :class:`voicepipe.backends.base.Backend` on a modelled device; one shared device per object."""

    kind = "hardware"

    def __init__(self, dep: Deployment, name: str, anchor: tuple[Anchor, str, Factors] | None = None) -> None:
        self.deployment = dep
        self.system = dep.system
        self.name = name
        self.anchor = anchor  # (anchor, its file, measured / modelled factors): step times re-anchored
        self.prices = prices_for(dep)
        self.quality = quality_of(dep.system.model.key)
        self.server = self.new_server()

    def new_server(self) -> DeviceServer:
        """A fresh device of this deployment (re-anchored where the backend has an anchor)."""
        dep = self.deployment
        kw: dict[str, Any] = {"max_batch": dep.max_batch, "spec": dep.spec, "prompt_cache": dep.prompt_cache}
        return DeviceServer(dep.system, **kw) if self.anchor is None else AnchoredServer(dep.system, self.anchor[2], **kw)

    def predict(self, req: LLMRequest, rng: np.random.Generator) -> Timing:
        """Idle device: deterministic physics (``rng`` unused)."""
        server = self.new_server()
        r = alone(server, req)  # the engine's run of this request with nothing else on the device
        if req.output_tokens > 1:
            return Timing(ttft_s=r.ttft_s, tpot_s=r.tpot_s)
        # no token after the first: the step it would decode at, as the engine times it
        ctx = mean_context(req.prompt_tokens, req.output_tokens)
        return Timing(ttft_s=r.ttft_s, tpot_s=server.step_ns(1, ctx, 0, 0) / 1e9 / server.tokens_per_step)

    def start(self, req: LLMRequest, t0_ns: int, rng: np.random.Generator) -> DeviceStream:
        return self.server.open(req, t0_ns)

    def describe(self) -> dict[str, object]:
        dep, sys_ = self.deployment, self.system
        probe = LLMRequest(session="describe", turn=0, prompt_tokens=1024, output_tokens=256)
        t = self.predict(probe, np.random.default_rng(0))
        return {
            "name": self.name,
            "kind": self.kind,
            "hardware": sys_.device.key,
            "model": sys_.model.key,
            "precision": sys_.precision,
            "kv_precision": sys_.kv,
            "stack": sys_.serving.key,
            "chips": sys_.chips,
            "max_batch": dep.max_batch,
            "context": dep.context,
            "fast": dep.fast,
            "prompt_cache": dep.prompt_cache,
            "eager": sys_.eager,
            "scheduler_steps": sys_.scheduler_steps,
            "max_num_tokens": sys_.max_num_tokens,
            "attention_dp": sys_.attention_dp,
            "speculative": None if dep.spec is None else dep.spec.__dict__,
            "modelled": True,
            "anchored": None if self.anchor is None else describe_anchor(*self.anchor),
            "ttft_ms_1024_prompt": t.ttft_s * 1e3,
            "tokens_per_s": 1.0 / t.tpot_s,
            "aggregate_tokens_per_s_at_max_batch": aggregate_tokens_per_s(dep, dep.max_batch),
            "price_in_per_mtok": self.prices.input_per_mtok,
            "price_out_per_mtok": self.prices.output_per_mtok,
            "price_source": self.prices.source,
            "quality": self.quality,
            "notes": list(dep.notes),
            "sources": {
                "device": dict(sys_.device.sources),
                "model": dict(sys_.model.sources),
                "stack": dict(sys_.serving.sources),
                "method": "MODELLED: voicepipe.hardware.model (docs/hardware-model.md)"
                + ("" if self.anchor is None else "; timings ANCHORED on a measurement (voicepipe.backends.anchor)"),
            },
        }


def backend_name(cfg: dict[str, Any], dep: Deployment) -> str:
    sys_ = dep.system
    name = f"{sys_.device.key}/{sys_.model.key}"
    if sys_.precision != sys_.model.default_precision:
        name += f"@{sys_.precision}"
    if cfg.get("kv_precision"):
        name += f"+kv{sys_.kv}"
    if cfg.get("stack"):
        name += f"+{sys_.serving.key}"
    if cfg.get("tp") is not None:
        name += f"+tp{sys_.chips}"
    if cfg.get("max_batch") is not None:
        name += f"+b{dep.max_batch}"
    if dep.spec is not None:
        name += "+spec"
    if dep.fast:
        name += "+fast"
    if not dep.prompt_cache:
        name += "+nocache"
    if sys_.eager:
        name += "+eager"
    if sys_.scheduler_steps > 1:
        name += f"+steps{sys_.scheduler_steps}"
    if sys_.max_num_tokens is not None:
        name += f"+tok{sys_.max_num_tokens}"
    if sys_.attention_dp:
        name += "+adp"
    return name


def make_hardware_backend(spec: str | dict[str, Any]) -> HardwareBackend:
    """Build a hardware backend from ``DEVICE/MODEL`` or a mapping (raises ValueError naming the bad field)."""
    cfg = parse_spec(spec)
    if not cfg.get("anchor"):
        dep = as_client(deploy(cfg))
        return HardwareBackend(dep, backend_name(cfg, dep))
    where = str(cfg.pop("anchor"))
    # as `hardware predict --anchor` refuses --eager, --scheduler-steps, --max-num-tokens and --attention-dp
    for key, unset in (("eager", (None, False)), ("scheduler_steps", (None, 1)), ("max_num_tokens", (None,)),
                       ("attention_dp", (None, False))):  # fmt: skip
        if cfg.get(key) is not True and cfg.get(key) in unset:
            continue
        raise ValueError(f"{key}: an anchored backend keeps the run settings of the anchor's own measurement")
    try:
        a = read_anchor(where)
        check_anchor(a, where, model(str(cfg["model"])).key)
        f = factors(a, where)
    except UserError as exc:
        raise ValueError(str(exc)) from None
    cfg = {**anchor_defaults(a, cfg), **cfg}
    dep = as_client(deploy(cfg))
    return HardwareBackend(dep, backend_name(cfg, dep) + "+anchored", (a, where, f))


def as_client(dep: Deployment) -> Deployment:
    """``dep`` answering a client-side TTFT (the stack's HTTP path included) whatever its stack's default
    timing: a pipeline calls the server over HTTP (``hardware sweep`` keeps the stack's own)."""
    return replace(dep, system=replace(dep.system, timing="client"))


def anchor_defaults(a: Anchor, cfg: dict[str, Any]) -> dict[str, Any]:
    """The anchor's precision, KV precision and stack where ``cfg`` names none and they differ from the
    defaults (a backend re-anchored on vLLM at fp8 runs vLLM at fp8)."""
    mdl = model(str(cfg["model"]))
    prec = str(cfg.get("precision") or a.precision)
    try:  # the KV format the target's stack would pick by itself (vLLM, SGLang: the 16-bit model dtype)
        kv_default = stack(str(cfg.get("stack") or a.stack)).kv_default
    except ValueError:  # a bad stack name: deploy() says so
        kv_default = "weights"
    out: dict[str, Any] = {}
    if a.precision != mdl.default_precision:
        out["precision"] = a.precision
    if a.kv_precision != default_kv_precision(prec, kv_default):
        out["kv_precision"] = a.kv_precision
    if a.stack != default_stack_name():
        out["stack"] = a.stack
    return {k: v for k, v in out.items() if cfg.get(k) is None}
