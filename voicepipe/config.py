"""The pipeline config: one YAML file, validated by pydantic, overridable with ``--set a.b=c``.

Every default carries its source. Durations are milliseconds; a ``Dist`` is a lognormal given by its
median and p90 (p90 == median makes it a constant).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import unquote

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from voicepipe.backends import UnknownBackend, build_backend, resolve_named, validate_spec
from voicepipe.backends.speech import AsrEngine, TtsEngine
from voicepipe.backends.speech_profile import apply_profiles
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.errors import UserError, from_validation, redact_url
from voicepipe.files import read_text, read_yaml_mapping
from voicepipe.limits import (
    MAX_CACHE_CAPACITY,
    MAX_CACHE_ENTRIES,
    MAX_CHUNK_TOKENS,
    MAX_LIST,
    MAX_MS,
    MAX_NAME,
    MAX_PROMPT_TOKENS,
    MAX_SECRET_BYTES,
    MAX_SEED,
    MAX_SPREAD_MS,
    MAX_TRIES,
    MAX_TURN_TIMEOUT_S,
    MAX_URL,
    MAX_WORDS,
    Ms,
    Name,
    Wpm,
)
from voicepipe.safeyaml import YamlRejected, load
from voicepipe.scenario import CacheEntry, Scenario, reply_speech_ms, too_long
from voicepipe.shipped import resolve_config
from voicepipe.speech_mix import mix_problem, real_speech_stages
from voicepipe.text import plain, speak

if TYPE_CHECKING:
    from voicepipe.bus.mqtt.address import BrokerAddress

Z90 = 1.2815515655446004


# Environment variables for broker credentials (never printed, logged or written anywhere).
USERNAME_ENV = "VOICEPIPE_BROKER_USERNAME"
PASSWORD_ENV = "VOICEPIPE_BROKER_PASSWORD"


class Strict(BaseModel):
    """Config models: unknown fields are errors; no coercion of text or booleans into numbers; no NaN/inf.
    Every duration, rate, count and text is bounded (voicepipe/limits.py says why each bound is where it is).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class Dist(Strict):
    """Lognormal duration by median and p90 (ms). Sampled with a per-(session, turn, stage) generator."""

    median: Ms
    p90: Ms

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, v: Any) -> Any:
        return {"median": v, "p90": v} if isinstance(v, int | float) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _order(self) -> Dist:
        if self.p90 < self.median:
            raise ValueError("p90 must be >= median")
        return self

    def sample_ms(self, rng: np.random.Generator) -> float:
        """One draw, at most MAX_MS (a modelled duration's bound): a valid but extreme shape (median 0.001,
        p90 260: σ ≈ 9.7) would otherwise draw hours, and a turn that can never be answered."""
        z = float(rng.standard_normal())  # always draw, so later draws don't shift with the shape
        if self.median == 0 or self.p90 == self.median:
            return self.median
        return min(self.median * math.exp(math.log(self.p90 / self.median) / Z90 * z), MAX_MS)


class BrokerConfig(Strict):
    """Where the bus is and how to log in. Credentials in a URL (``mqtt://user:pass@host``) move into
    ``username``/``password`` at validation, so ``url`` never holds a secret. The password is a SecretStr:
    dumps, reprs and the report show ``***``. Prefer ``password_file`` or ``$VOICEPIPE_BROKER_PASSWORD``
    to a password on the command line or in a config file."""

    # mqtt://host:port or mqtts://host:port (TLS); None -> embedded amqtt broker
    url: str | None = Field(None, max_length=MAX_URL)
    username: str | None = Field(None, max_length=MAX_NAME)  # default: $VOICEPIPE_BROKER_USERNAME
    # default: $VOICEPIPE_BROKER_PASSWORD
    password: SecretStr | None = Field(None, max_length=MAX_SECRET_BYTES)
    password_file: str | None = None  # a file whose first line is the password (read at load time)
    ca_file: str | None = None  # PEM CA bundle that signed the broker's certificate (default: system CAs)
    cert_file: str | None = None  # client certificate (PEM), for brokers that require one
    key_file: str | None = None  # its unencrypted private key (PEM), unless inside cert_file
    # TLS without verifying the broker's certificate: set only by the --insecure flag, never from a file
    insecure: bool = False
    qos: Literal[0, 1] = 1  # design.md §3: QoS 1 for turn-critical messages
    probe: bool = True  # round-trip probe at start that detects Nagle stalls
    probe_warn_ms: Ms = 15.0
    # MQTT version of the stages' clients: "auto" = 5 for a broker URL (3.1.1 when the broker refuses 5),
    # 3.1.1 for the embedded amqtt (it speaks nothing else)
    protocol: Literal["auto", "3.1.1", "5"] = "auto"
    # a lost broker connection is retried (backoff + jitter) this long; turns meanwhile carry the outage in
    # their latency (broker_outage_ms); longer ends the run with exit code 4, what was measured kept
    outage_window_s: float = Field(30.0, gt=0, le=MAX_TURN_TIMEOUT_S)
    # a stage process silent this long (SIGSTOP, a frozen VM) is dead and its sessions move to a replica; one
    # that beats again sooner resumes them. Default: the broker's own will-on-silence, 1.5 x a 5 s keep-alive
    # (MQTT 3.1.1 §3.1.2.10; voicepipe.bus.liveness.PAUSE_GRACE_S)
    stage_grace_s: float = Field(7.5, ge=1.5, le=MAX_TURN_TIMEOUT_S)

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # YAML reads `5` as a number

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_url(cls, v: Any) -> Any:
        """Move ``user:pass@`` out of the URL; a username/password given as fields wins over the URL's."""
        if not isinstance(v, dict) or not isinstance(v.get("url"), str) or "@" not in v["url"]:
            return v
        url: str = v["url"]
        scheme, sep, rest = url.partition("://")
        netloc, slash, path = (rest if sep else url).partition("/")
        userinfo, at, hostport = netloc.rpartition("@")
        if not at:
            return v
        user, colon, password = userinfo.partition(":")
        out = dict(v, url=f"{scheme}{sep}{hostport}{slash}{path}" if sep else f"{hostport}{slash}{path}")
        if user and not v.get("username"):
            out["username"] = unquote(user)
        if colon and v.get("password") is None:
            out["password"] = unquote(password)
        return out


class TransportConfig(Strict):
    """Mouth-to-ASR and TTS-to-ear paths. Source: Daily, "Voice AI & Voice Agents: An Illustrated Primer"
    (2025), voice-to-voice budget table: mic 40, Opus encode 21, network 10, packet 2, jitter buffer 40,
    decode 1 (uplink 114); return path 74 + speaker 15 (downlink 89)."""

    uplink_ms: Ms = 114.0
    downlink_ms: Ms = 89.0
    # a stop (barge-in) reaches the speaker over network 10 + packet handling 2 + speaker output 15; the
    # client drops its jitter buffer at once (same Daily primer figures)
    stop_ms: Ms = 27.0


class VADConfig(Strict):
    """Voice activity detection (real audio only): ``model`` is the modelled path (no audio flows)."""

    engine: Literal["model", "silero", "webrtc"] = "model"
    threshold: float = Field(0.5, gt=0, lt=1)  # Silero: speech probability counted as speech
    webrtc_mode: int = Field(2, ge=0, le=3)  # WebRTC VAD aggressiveness
    min_speech_ms: Ms = 40.0  # speech this long (consecutive frames) starts a segment: a click does not


class ASRConfig(Strict):
    engine: AsrEngine = "model"  # model | pocketsphinx | a speech endpoint (URL or mapping)
    endpointing: Literal["silence", "smart"] = "silence"
    # Pipecat VAD stop_secs 0.2 s (2026 default); LiveKit/OpenAI use 0.5 s. reference-figures.md
    silence_ms: Ms = 200.0
    # smart endpointing (issue 4): short wait when the utterance looks complete, long when not.
    # Smart Turn v3: 12 ms CPU inference, 3 s fallback (Pipecat docs, reference-figures.md).
    smart_complete_ms: Ms = 120.0
    smart_incomplete_ms: Ms = 1500.0
    smart_inference_ms: Ms = 12.0
    smart_source: Literal["annotation", "heuristic"] = "annotation"
    # Transcript finalisation after the endpoint. Daily primer budgets 300 ms for transcription +
    # endpointing; with a 200 ms VAD wait that leaves ~100 ms (Deepgram nova-3 p50 247 ms incl. VAD wait,
    # Pipecat stt-benchmark). p90 from the same benchmark's spread.
    finalize_ms: Dist = Dist(median=100.0, p90=140.0)
    profile: str | None = Field(None, max_length=4096)  # `calibrate --stage asr` file: sets finalize_ms


class RuleWhen(Strict):
    """All given conditions must hold (absent ones match anything)."""

    intent: list[Name] | None = Field(None, max_length=MAX_LIST)
    complexity: list[Literal["low", "medium", "high"]] | None = None
    keywords: list[Name] | None = Field(
        None, max_length=MAX_LIST
    )  # any of these words in the final transcript
    max_words: int | None = Field(None, ge=0, le=MAX_WORDS)
    min_words: int | None = Field(None, ge=0, le=MAX_WORDS)


class Rule(Strict):
    when: RuleWhen = RuleWhen()
    to: Name  # "cache", "council", "agent" (the main one) or "agent:NAME"


class PreemptiveConfig(Strict):
    """Start the LLM on an eager end of turn — the partial transcript has been stable through
    ``stable_ms`` of silence (shorter than the endpoint wait) — then commit or cancel at the final.

    LiveKit's preemptive generation: LLM only (TTS waits), <= 3 tries per turn, reused only if the final
    transcript matches ignoring case and punctuation (reference-figures.md)."""

    enabled: bool = False
    stable_ms: Ms = 150.0
    max_tries: int = Field(3, ge=1, le=MAX_TRIES)


class RouterConfig(Strict):
    policy: Literal["single", "rules", "classifier"] = "single"
    agent: Name | None = None  # the agent `single` and preemptive routes go to (None: agent.name)
    rules: list[Rule] = Field(default_factory=list, max_length=MAX_LIST)  # policy `rules`: first match wins
    default: Name = "agent"  # where `rules` sends a turn no rule matched
    # policy `classifier`: a small built-in complexity classifier (modelled, e.g. a BERT-size model on
    # CPU: ~5-15 ms; RouteLLM-style one routing step). Routes low -> `classifier_low`, else `default`.
    classifier_ms: Ms = 10.0
    classifier_low: Name = "cache"
    cache_first: bool = False  # try the cache before any agent route (a miss falls through)
    preemptive: PreemptiveConfig = PreemptiveConfig()


def _cache_entry(v: Any) -> dict[str, Any]:
    return CacheEntry.model_validate(v).model_dump()


class CacheConfig(Strict):
    """Speculative response cache. GPTCache defaults: similarity threshold 0.8, LRU 1,000 entries."""

    enabled: bool = False
    threshold: float = Field(0.8, ge=0, le=1)
    partial_threshold: float = Field(0.9, ge=0, le=1)  # confidence needed to pre-render on a partial
    capacity: int = Field(1000, ge=0, le=MAX_CACHE_CAPACITY)  # learned entries (LRU)
    learn: bool = True  # answers generated earlier become entries
    lookup_ms: Ms = 2.0  # modelled embedding + lookup time
    # {questions: [...], answer: ...}, checked like a scenario's cache entries
    entries: list[Annotated[dict[str, Any], BeforeValidator(_cache_entry)]] = Field(
        default_factory=list, max_length=MAX_CACHE_ENTRIES
    )


class CouncilConfig(Strict):
    members: list[str | dict[str, Any]] = Field(default_factory=list, max_length=MAX_LIST)
    aggregation: Literal["first", "vote", "judge", "draft-refine"] = "first"
    k: int = Field(2, ge=1, le=MAX_LIST)  # vote: the first k complete answers vote
    judge: str | dict[str, Any] | None = None  # judge / refine backend (default: first member)
    judge_gain: float = Field(0.02, ge=0, le=1)  # modelled accuracy a judge adds over its best member
    deadline_ms: float = Field(3000.0, gt=0, le=MAX_MS)  # members not done by then are dropped

    @field_validator("members", "judge")
    @classmethod
    def _known(cls, v: Any) -> Any:
        for spec in v if isinstance(v, list) else ([v] if v is not None else []):
            try:
                validate_spec(spec)
            except UnknownBackend as exc:
                raise ValueError(str(exc)) from None
        return v


class AgentConfig(Strict):
    name: Name = "main"
    backend: str | dict[str, Any] = "sonnet-gpu"
    # further named agents a router can send turns to: {fast: cerebras-llama-3.1-8b, ...}
    extra: dict[Name, str | dict[str, Any]] = Field(default_factory=dict, max_length=MAX_LIST)
    # system prompt + tools + history before the first turn; history grows each turn
    prompt_tokens: int = Field(1000, ge=0, le=MAX_PROMPT_TOKENS)
    chunk_tokens: int = Field(
        12, ge=1, le=MAX_CHUNK_TOKENS
    )  # text streams in chunks: at clause ends or this many tokens

    @field_validator("backend")
    @classmethod
    def _known(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
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
    engine: TtsEngine = "model"  # model | espeak-ng | a speech endpoint (URL or mapping)
    voice: str = Field("en-us", pattern=r"^[A-Za-z0-9_+-]{1,40}$")  # espeak-ng voice of the reply
    # Cartesia Sonic-3 p50 188 ms time to first audio (Coval independent benchmark, May 2026); p90 assumed.
    ttfb_ms: Dist = Dist(median=188.0, p90=260.0)
    profile: str | None = Field(None, max_length=4096)  # `calibrate --stage tts` file: sets ttfb_ms
    aggregate: Literal["clause", "sentence"] = "clause"
    min_clause_words: int = Field(3, ge=1, le=MAX_LIST)  # don't synthesise a lone "Sure," — too choppy
    words_per_minute: Wpm = 165.0  # speaking rate of the reply audio
    # barge-in: VAD onset before TTS stops (Silero VAD frames are 32 ms; a start needs ~2 — modelled)
    barge_in_detect_ms: Ms = 64.0


class ClientConfig(Strict):
    # how the caller speaks: ``model`` sends timed words (no audio), ``espeak-ng`` speaks real audio frames
    voice: Literal["model", "espeak-ng"] = "model"
    espeak_voice: str = Field("en-us", pattern=r"^[A-Za-z0-9_+-]{1,40}$")
    record: str | None = Field(None, max_length=4096)  # real audio: write one stereo WAV per session here
    playout: Literal["full", "first_audio"] = "full"  # listen to whole replies, or move on at first audio
    turn_timeout_s: float = Field(20.0, gt=0, le=MAX_TURN_TIMEOUT_S)
    words_per_minute: Wpm = 150.0  # default user speaking rate when a turn gives none
    # concurrent sessions start evenly spread over this window (0: all at once, the worst-case burst)
    start_spread_ms: float = Field(0.0, ge=0, le=MAX_SPREAD_MS)


class PipelineConfig(Strict):
    budget_ms: float = Field(800.0, gt=0, le=MAX_MS)  # Daily: 800 ms voice-to-voice median target (2024)
    seed: int = Field(0, ge=-MAX_SEED, le=MAX_SEED)
    broker: BrokerConfig = BrokerConfig()
    transport: TransportConfig = TransportConfig()
    vad: VADConfig = VADConfig()
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
        return resolve_named(data)

    @model_validator(mode="after")
    def _routes_exist(self) -> PipelineConfig:
        """Every route the router can take must lead somewhere (else turns would silently time out)."""
        names = sorted(self.agent.backends())
        if self.main_agent not in names:
            agents = ", ".join(names)
            raise ValueError(f"router.agent: {self.main_agent!r} is not an agent (agents: {agents})")
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

    @model_validator(mode="after")
    def _audio_mix_coherent(self) -> PipelineConfig:
        """Each speech stage real or modelled, in a mix that can run (:mod:`voicepipe.speech_mix`)."""
        if why := mix_problem(self.client.voice, self.vad.engine, self.asr.engine, self.tts.engine):
            raise ValueError(why)
        return self

    @property
    def audio_caller(self) -> bool:  # the client speaks and listens in audio frames (and times by ear)
        return self.client.voice != "model"

    @property
    def real_stages(self) -> list[str]:  # the speech stages on real engines (each turn's record names them)
        return real_speech_stages(self.client.voice, self.vad.engine, self.asr.engine, self.tts.engine)

    @model_validator(mode="after")
    def _answers_speakable(self) -> PipelineConfig:
        """The config's own cache answers, at its TTS speaking rate (a scenario's lines: check_speech)."""
        wpm = self.tts.words_per_minute
        for j, e in enumerate(self.cache.entries):
            where, ms = f"cache.entries.{j}.answer", reply_speech_ms(e["answer"], wpm)
            said = too_long(where, ms, f"tts.words_per_minute {wpm:g}")
            if said:
                raise ValueError(said)
        return self

    @property
    def main_agent(self) -> str:
        """The agent single and preemptive routes go to."""
        return self.router.agent or self.agent.name

    def backend_label(self) -> str:
        b = self.agent.backend
        if isinstance(b, dict) and "hardware" not in b:  # an endpoint or an inline profile
            return build_backend(b).name
        if isinstance(b, dict):
            return f"{b.get('hardware')}/{b.get('model')}"
        return b


def _parse_value(raw: str) -> Any:
    """A --set value as YAML (the same restricted reader as files); anything it refuses stays text."""
    try:
        return load(raw)
    except YamlRejected:
        return raw


def apply_set(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``path.to.field=value`` (value parsed as YAML) to a nested dict in place."""
    if "=" not in assignment:
        raise UserError("--set", f"{assignment!r}: expected path.to.field=value")
    path, raw = assignment.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise UserError("--set", f"{assignment!r}: empty field path")
    if keys == ["broker", "password"]:  # the value would show in ps, shell history and compare labels
        raise UserError(
            "--set", "broker.password: give it with --password-file or $VOICEPIPE_BROKER_PASSWORD"
        )
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


@dataclass(frozen=True)
class BrokerOverrides:
    """Broker options given on the command line; they win over the config file and the environment."""

    url: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    password_file: str | None = None
    insecure: bool = False

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


def read_secret(path: str) -> str:
    """The first line of a password file (size-limited like every file we read)."""
    text = read_text(Path(path), limit=MAX_SECRET_BYTES)
    secret = text.splitlines()[0] if text else ""
    if not secret:
        raise UserError(path, "the first line (the password) is empty")
    return secret


def _resolve_broker(cfg: PipelineConfig, source: str) -> None:
    """Fill the password from ``password_file`` or the environment, the username from the environment,
    and check the URL and TLS files now (one line at load time rather than an error mid-run)."""
    b = cfg.broker
    if b.password_file:
        if b.password is not None:
            raise UserError(
                source, "broker.password_file: a password is also given (password or URL); give one"
            )
        try:
            b.password = SecretStr(read_secret(b.password_file))
        except UserError as exc:
            raise UserError(source, f"broker.password_file: {exc}") from None
    elif b.password is None and os.environ.get(PASSWORD_ENV):
        b.password = SecretStr(os.environ[PASSWORD_ENV])
    if b.username is None and os.environ.get(USERNAME_ENV):
        b.username = os.environ[USERNAME_ENV]
    if not b.url:
        tls = [k for k in ("ca_file", "cert_file", "key_file") if getattr(b, k)] + (
            ["insecure"] if b.insecure else []
        )
        if tls:
            raise UserError(source, f"broker.{tls[0]}: TLS options need an mqtts:// broker URL (none given)")
        return
    try:
        broker_address(b)
    except UserError as exc:
        raise UserError(source, str(exc)) from None


def broker_address(broker: BrokerConfig) -> BrokerAddress:
    """The address of a validated ``broker`` config section (``url`` must be set)."""
    if not broker.url:
        raise UserError("broker.url", "no broker URL")
    return BrokerAddress.parse(
        broker.url,
        broker.username,
        broker.password.get_secret_value() if broker.password is not None else None,
        ca_file=broker.ca_file,
        cert_file=broker.cert_file,
        key_file=broker.key_file,
        insecure=broker.insecure,
    )


def load_config(
    path: str | Path | None = None,
    sets: list[str] | tuple[str, ...] = (),
    broker: str | BrokerOverrides | None = None,
) -> PipelineConfig:
    """The config from ``path`` (None or an empty file: all defaults), then ``--set`` overrides, then the
    command line's broker options. Every problem is one :class:`UserError` naming the file and the field."""
    overrides = broker if isinstance(broker, BrokerOverrides) else BrokerOverrides(url=broker)
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        source = str(path)
        data = read_yaml_mapping(resolve_config(path))  # a file, else a shipped config by name
    data = _merge(PipelineConfig().model_dump(mode="python"), data)
    env_broker = os.environ.get("VOICEPIPE_BROKER")
    if env_broker and not overrides.url:
        data.setdefault("broker", {})
        if isinstance(data["broker"], dict) and not data["broker"].get("url"):
            data["broker"]["url"] = env_broker
    for s in sets:
        apply_set(data, s)
    where = source if not sets else f"{source} (with --set)"
    apply_profiles(data)  # asr.profile / tts.profile: the measured figure replaces the modelled one
    if isinstance(data.get("broker"), dict) and data["broker"].get("insecure") is not False:
        # a shared config file must not switch certificate checks off for whoever runs it
        raise UserError(where, "broker.insecure: only the --insecure flag turns certificate verification off")
    if overrides.fields() and isinstance(data.get("broker"), dict):
        data["broker"].update(overrides.fields())
        if overrides.password_file:
            data["broker"]["password"] = None  # the command line's password file wins over the config's
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise from_validation(where, exc, model=PipelineConfig) from None
    _resolve_broker(cfg, where)
    return cfg


def config_dict(cfg: PipelineConfig) -> dict[str, Any]:
    """The redacted view of a config, for anything written out (the report's config section): the
    password is ``***`` and no URL carries one. The only way a config is serialised."""
    d = cfg.model_dump(mode="json")
    if cfg.broker.password is not None:
        d["broker"]["password"] = "***"
    if d["broker"].get("url"):
        d["broker"]["url"] = redact_url(d["broker"]["url"])
    return d


def check_speech(cfg: PipelineConfig, scenarios: list[Scenario]) -> None:
    """Refuse (:class:`UserError` naming the scenario file and field) any utterance, reply or cached answer
    that takes longer than :data:`voicepipe.limits.MAX_SPEECH_MS` to say at the speaking rate it gets:
    a turn's own ``words_per_minute`` or the config's ``client.words_per_minute`` for the user (pauses
    included), ``tts.words_per_minute`` for replies and answers. Only now are text and rate both known."""
    tts = cfg.tts.words_per_minute
    for sc in scenarios:
        for i, t in enumerate(sc.turns):
            if t.wav is not None and "asr" not in cfg.real_stages and not plain(t.user):
                why = f"turns.{i}.wav: a recorded turn without `user` text needs a real ASR (--audio real)"
                raise UserError(sc.source or sc.name, why)
            wpm = t.words_per_minute or cfg.client.words_per_minute
            words = speak(t.user, wpm)
            rate = f"{wpm:g} words per minute" + ("" if t.words_per_minute else " (client.words_per_minute)")
            said = too_long(f"turns.{i}.user", words[-1].end_ms if words else 0.0, rate)
            said = said or too_long(
                f"turns.{i}.reply", reply_speech_ms(t.reply, tts), f"tts.words_per_minute {tts:g}"
            )
            if said:
                raise UserError(sc.source or sc.name, said)
        for j, e in enumerate(sc.cache):
            said = too_long(
                f"cache.{j}.answer", reply_speech_ms(e.answer, tts), f"tts.words_per_minute {tts:g}"
            )
            if said:
                raise UserError(sc.source or sc.name, said)
