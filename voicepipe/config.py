"""The pipeline config: one YAML file, validated by pydantic, overridable with ``--set a.b=c``.

Every default carries its source. Durations are milliseconds; a ``Dist`` is a lognormal given by its
median and p90 (p90 == median makes it a constant).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from voicepipe.errors import UserError, from_validation, read_yaml_mapping

Z90 = 1.2815515655446004


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Dist(Strict):
    """Lognormal duration by median and p90 (ms). Sampled with a per-(session, turn, stage) generator."""

    median: float = Field(ge=0)
    p90: float = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, v: Any) -> Any:
        return {"median": v, "p90": v} if isinstance(v, int | float) else v

    @model_validator(mode="after")
    def _order(self) -> Dist:
        if self.p90 < self.median:
            raise ValueError("p90 must be >= median")
        return self

    def sample_ms(self, rng: np.random.Generator) -> float:
        z = float(rng.standard_normal())  # always draw, so later draws don't shift with the shape
        if self.median == 0 or self.p90 == self.median:
            return self.median
        return self.median * math.exp(math.log(self.p90 / self.median) / Z90 * z)


class BrokerConfig(Strict):
    url: str | None = None  # mqtt://[user:pass@]host:port ; None -> embedded amqtt broker
    username: str | None = None
    password: str | None = None
    qos: Literal[0, 1] = 1  # design.md §3: QoS 1 for turn-critical messages
    probe: bool = True  # round-trip probe at start that detects Nagle stalls
    probe_warn_ms: float = 15.0


class TransportConfig(Strict):
    """Mouth-to-ASR and TTS-to-ear paths. Source: Daily, "Voice AI & Voice Agents: An Illustrated Primer"
    (2025), voice-to-voice budget table: mic 40, Opus encode 21, network 10, packet 2, jitter buffer 40,
    decode 1 (uplink 114); return path 74 + speaker 15 (downlink 89)."""

    uplink_ms: float = Field(114.0, ge=0)
    downlink_ms: float = Field(89.0, ge=0)
    # a stop (barge-in) reaches the speaker over network 10 + packet handling 2 + speaker output 15; the
    # client drops its jitter buffer at once (same Daily primer figures)
    stop_ms: float = Field(27.0, ge=0)


class ASRConfig(Strict):
    endpointing: Literal["silence", "smart"] = "silence"
    # Pipecat VAD stop_secs 0.2 s (2026 default); LiveKit/OpenAI use 0.5 s. reference-figures.md
    silence_ms: float = Field(200.0, ge=0)
    # smart endpointing (issue 4): short wait when the utterance looks complete, long when not.
    # Smart Turn v3: 12 ms CPU inference, 3 s fallback (Pipecat docs, reference-figures.md).
    smart_complete_ms: float = Field(120.0, ge=0)
    smart_incomplete_ms: float = Field(1500.0, ge=0)
    smart_inference_ms: float = Field(12.0, ge=0)
    smart_source: Literal["annotation", "heuristic"] = "annotation"
    # Transcript finalisation after the endpoint. Daily primer budgets 300 ms for transcription +
    # endpointing; with a 200 ms VAD wait that leaves ~100 ms (Deepgram nova-3 p50 247 ms incl. VAD wait,
    # Pipecat stt-benchmark). p90 from the same benchmark's spread.
    finalize_ms: Dist = Dist(median=100.0, p90=140.0)


class RuleWhen(Strict):
    """All given conditions must hold (absent ones match anything)."""

    intent: list[str] | None = None
    complexity: list[Literal["low", "medium", "high"]] | None = None
    keywords: list[str] | None = None  # any of these words in the final transcript
    max_words: int | None = None
    min_words: int | None = None


class Rule(Strict):
    when: RuleWhen = RuleWhen()
    to: str  # "cache", "council", "agent" (the main one) or "agent:NAME"


class PreemptiveConfig(Strict):
    """Start the LLM on an eager end of turn — the partial transcript has been stable through
    ``stable_ms`` of silence (shorter than the endpoint wait) — then commit or cancel at the final.

    LiveKit's preemptive generation: LLM only (TTS waits), <= 3 tries per turn, reused only if the final
    transcript matches ignoring case and punctuation (reference-figures.md)."""

    enabled: bool = False
    stable_ms: float = Field(150.0, ge=0)
    max_tries: int = Field(3, ge=1)


class RouterConfig(Strict):
    policy: Literal["single", "rules", "classifier"] = "single"
    agent: str | None = None  # the agent `single` and preemptive routes go to (None: agent.name)
    rules: list[Rule] = Field(default_factory=list)  # policy `rules`: first match wins
    default: str = "agent"  # where `rules` sends a turn no rule matched
    # policy `classifier`: a small built-in complexity classifier (modelled, e.g. a BERT-size model on
    # CPU: ~5-15 ms; RouteLLM-style one routing step). Routes low -> `classifier_low`, else `default`.
    classifier_ms: float = Field(10.0, ge=0)
    classifier_low: str = "cache"
    cache_first: bool = False  # try the cache before any agent route (a miss falls through)
    preemptive: PreemptiveConfig = PreemptiveConfig()


class CacheConfig(Strict):
    """Speculative response cache. GPTCache defaults: similarity threshold 0.8, LRU 1,000 entries."""

    enabled: bool = False
    threshold: float = Field(0.8, ge=0, le=1)
    partial_threshold: float = Field(0.9, ge=0, le=1)  # confidence needed to pre-render on a partial
    capacity: int = Field(1000, ge=0)  # learned entries (LRU)
    learn: bool = True  # answers generated earlier become entries
    lookup_ms: float = Field(2.0, ge=0)  # modelled embedding + lookup time
    entries: list[dict[str, Any]] = Field(default_factory=list)  # {questions: [...], answer: ...}


class CouncilConfig(Strict):
    members: list[str | dict[str, Any]] = Field(default_factory=list)
    aggregation: Literal["first", "vote", "judge", "draft-refine"] = "first"
    k: int = Field(2, ge=1)  # vote: the first k complete answers vote
    judge: str | dict[str, Any] | None = None  # judge / refine backend (default: first member)
    judge_gain: float = Field(0.02, ge=0, le=1)  # modelled accuracy a judge adds over its best member
    deadline_ms: float = Field(3000.0, gt=0)  # members not done by then are dropped

    @field_validator("members", "judge")
    @classmethod
    def _known(cls, v: Any) -> Any:
        from voicepipe.backends import UnknownBackend, validate_spec

        for spec in v if isinstance(v, list) else ([v] if v is not None else []):
            try:
                validate_spec(spec)
            except UnknownBackend as exc:
                raise ValueError(str(exc)) from None
        return v


class AgentConfig(Strict):
    name: str = "main"
    backend: str | dict[str, Any] = "sonnet-gpu"
    # further named agents a router can send turns to: {fast: cerebras-llama-3.1-8b, ...}
    extra: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    # system prompt + tools + history before the first turn; history grows each turn
    prompt_tokens: int = Field(1000, ge=0)
    chunk_tokens: int = Field(12, ge=1)  # text streams in chunks: at clause ends or this many tokens

    @field_validator("backend")
    @classmethod
    def _known(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        from voicepipe.backends import UnknownBackend, validate_spec

        try:
            validate_spec(v)
        except UnknownBackend as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("extra")
    @classmethod
    def _known_extra(cls, v: dict[str, Any]) -> dict[str, Any]:
        for spec in v.values():
            cls._known(spec)
        return v

    def backends(self) -> dict[str, str | dict[str, Any]]:
        return {self.name: self.backend, **self.extra}


class TTSConfig(Strict):
    # Cartesia Sonic-3 p50 188 ms time to first audio (Coval independent benchmark, May 2026); p90 assumed.
    ttfb_ms: Dist = Dist(median=188.0, p90=260.0)
    aggregate: Literal["clause", "sentence"] = "clause"
    min_clause_words: int = Field(3, ge=1)  # don't synthesise a lone "Sure," — too choppy
    words_per_minute: float = Field(165.0, gt=0)  # speaking rate of the reply audio
    # barge-in: VAD onset before TTS stops (Silero VAD frames are 32 ms; a start needs ~2 — modelled)
    barge_in_detect_ms: float = Field(64.0, ge=0)


class ClientConfig(Strict):
    playout: Literal["full", "first_audio"] = "full"  # listen to whole replies, or move on at first audio
    turn_timeout_s: float = Field(20.0, gt=0)
    words_per_minute: float = Field(150.0, gt=0)  # default user speaking rate when a turn gives none
    # concurrent sessions start evenly spread over this window (0: all at once, the worst-case burst)
    start_spread_ms: float = Field(0.0, ge=0)


class PipelineConfig(Strict):
    budget_ms: float = Field(800.0, gt=0)  # Daily: 800 ms voice-to-voice median target (2024)
    seed: int = 0
    broker: BrokerConfig = BrokerConfig()
    transport: TransportConfig = TransportConfig()
    asr: ASRConfig = ASRConfig()
    router: RouterConfig = RouterConfig()
    agent: AgentConfig = AgentConfig()
    tts: TTSConfig = TTSConfig()
    cache: CacheConfig = CacheConfig()
    council: CouncilConfig = CouncilConfig()
    client: ClientConfig = ClientConfig()
    # reusable backend specs by name (`agent.backend: my-vllm`): endpoints, profile files, hardware
    backends: dict[str, str | dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _named_backends(cls, data: Any) -> Any:
        from voicepipe.backends import resolve_named

        return resolve_named(data)

    @model_validator(mode="after")
    def _routes_exist(self) -> PipelineConfig:
        """Every route the router can take must lead somewhere (else turns would silently time out)."""
        names = sorted(self.agent.backends())
        if self.main_agent not in names:
            raise ValueError(
                f"router.agent: {self.main_agent!r} is not an agent (agents: {', '.join(names)})"
            )
        dests = {"router.default": self.router.default, "router.classifier_low": self.router.classifier_low}
        dests |= {f"router.rules.{i}.to": r.to for i, r in enumerate(self.router.rules)}
        for where, dest in dests.items():
            if dest == "council" and not self.council.members:
                raise ValueError(f"{where}: routes to the council, but council.members is empty")
            if dest in ("cache", "council", "agent") or (dest.startswith("agent:") and dest[6:] in names):
                continue
            raise ValueError(
                f"{where}: {dest!r} is not cache, council, agent or agent:NAME (agents: {', '.join(names)})"
            )
        return self

    @property
    def main_agent(self) -> str:
        """The agent single and preemptive routes go to."""
        return self.router.agent or self.agent.name

    def backend_label(self) -> str:
        b = self.agent.backend
        if isinstance(b, dict) and "hardware" not in b:  # an endpoint or an inline profile
            from voicepipe.backends import build_backend

            return build_backend(b).name
        if isinstance(b, dict):
            return f"{b.get('hardware')}/{b.get('model')}"
        return b


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_set(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``path.to.field=value`` (value parsed as YAML) to a nested dict in place."""
    if "=" not in assignment:
        raise UserError("--set", f"{assignment!r}: expected path.to.field=value")
    path, raw = assignment.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise UserError("--set", f"{assignment!r}: empty field path")
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            node[k] = nxt
        node = nxt
    node[keys[-1]] = _parse_value(raw)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, recursively for mappings (so --set a.b=1 keeps a's other fields)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(
    path: str | Path | None = None, sets: list[str] | tuple[str, ...] = (), broker: str | None = None
) -> PipelineConfig:
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise UserError(source, "no such file")
        data = read_yaml_mapping(p)
    data = _merge(PipelineConfig().model_dump(mode="python"), data)
    env_broker = os.environ.get("VOICEPIPE_BROKER")
    if env_broker and not broker:
        data.setdefault("broker", {})
        if isinstance(data["broker"], dict) and not data["broker"].get("url"):
            data["broker"]["url"] = env_broker
    for s in sets:
        apply_set(data, s)
    if broker:
        apply_set(data, f"broker.url={broker}")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        where = source if not sets else f"{source} (with --set)"
        raise from_validation(where, exc) from None


def config_dict(cfg: PipelineConfig) -> dict[str, Any]:
    d = cfg.model_dump(mode="json")
    if d["broker"].get("password"):
        d["broker"]["password"] = "***"
    return d
