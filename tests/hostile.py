"""~110 hostile scenario and config files (generated, not stored): file-level problems (size, encoding,
type, YAML tricks) shared by both, config-specific and scenario-specific ones, and hostile JSON files (a
model's config.json, a vLLM result). Each names a ``needle`` the one-line error must contain: the field, or
what is wrong with the file. Used by tests/test_bad_files.py, tests/test_file_guard.py and
bench/bad_files.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from voicepipe.limits import MAX_FILE_BYTES

BOMB = "".join(
    [
        'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
        *(f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9)),
    ]
)
TURN = "  - user: hi there\n    reply: hello, how can I help?\n"


@dataclass(frozen=True)
class Hostile:
    name: str
    needle: str  # must appear in the error line (the field, or what is wrong with the file)
    content: str | bytes | None = None  # None: ``make`` builds the path
    make: Callable[[Path], Path] | None = None
    suffix: str = ".yaml"

    def write(self, d: Path) -> Path:
        if self.make is not None:
            return self.make(d / self.name)
        p = d / f"{self.name}{self.suffix}"
        if isinstance(self.content, bytes):
            p.write_bytes(self.content)
        else:
            p.write_text(self.content or "", encoding="utf-8")
        return p


def _dir(p: Path) -> Path:
    p.mkdir()
    return p


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _char_device(p: Path) -> Path:
    return Path("/dev/zero")  # endless: a reader that does not check the file type never returns


def _sparse(p: Path, size: int, suffix: str) -> Path:
    f = p.with_suffix(suffix)
    with f.open("wb") as fh:  # a hole: takes no disk, but a reader that reads before checking reads it all
        fh.truncate(size)
    return f


def _missing(p: Path) -> Path:
    return p.with_suffix(".yaml")


def _huge(p: Path) -> Path:
    f = p.with_suffix(".yaml")
    with f.open("wb") as fh:  # 10 MB of valid YAML comments: rejected by size, never parsed
        fh.write(b"# padding padding padding padding padding padding padding padding padding pad\n" * 131_072)
    return f


FILE_LEVEL = [
    Hostile("directory", "is a directory", make=_dir),
    Hostile("fifo", "not a regular file", make=_fifo),
    Hostile("char-device", "not a regular file (a character device)", make=_char_device),
    Hostile("sparse-1gb", "bytes", make=lambda p: _sparse(p, 1 << 30, ".yaml")),
    Hostile("missing", "no such", make=_missing),
    Hostile("huge-10mb", "bytes", make=_huge),
    Hostile("just-over-limit", "bytes", "#" * (MAX_FILE_BYTES + 1)),
    Hostile("not-utf8", "not UTF-8", b"\xff\xfe\x00\x01budget_ms: 1\n"),
    Hostile("latin1", "not UTF-8", "name: caf\xe9\n".encode("latin-1")),
    Hostile("nul-byte", "invalid YAML", "a: \x00\n"),
    Hostile("top-list", "top level must be", "- a\n- b\n"),
    Hostile("top-scalar", "top level must be", "42\n"),
    Hostile("top-string", "top level must be", "just some words\n"),
    Hostile("alias-bomb", "aliases", BOMB),
    Hostile("recursive-alias", "nested deeper", "a: &a [*a]\n"),
    Hostile(
        "deep-nesting", "nested deeper", "".join(f"{'  ' * i}k{i}:\n" for i in range(60)) + "  " * 60 + "v\n"
    ),
    Hostile("flow-nesting", "invalid YAML", "a: " + "[" * 5000 + "]" * 5000 + "\n"),
    Hostile("python-tag", "tag !!python/object/apply:os.system", "a: !!python/object/apply:os.system [ls]\n"),
    Hostile("python-name", "tag !!python/name:os.system", "a: !!python/name:os.system ''\n"),
    Hostile("binary-tag", "tag !!binary", "a: !!binary aGVsbG8=\n"),
    Hostile("set-tag", "tag !!set", "a: !!set {x, y}\n"),
    Hostile("custom-tag", "tag !env", "a: !env HOME\n"),
    Hostile("dup-top", "duplicate key", "k: 1\nk: 2\n"),
    Hostile("int-key", "key 1 is not text", "1: 2\n"),
    Hostile("bool-key", "key True is not text", "yes: 1\n"),
    Hostile("complex-key", "a key must be plain text", "? [a, b]\n: c\n"),
    Hostile("syntax", "invalid YAML", "a: [\n"),
    Hostile("tab-indent", "invalid YAML", "a:\n\tb: 1\n"),
    Hostile("two-documents", "another document", "---\na: 1\n---\nb: 2\n"),
    Hostile("huge-int", "too many digits", "a: " + "9" * 5000 + "\n"),
]


def cfg(name: str, needle: str, text: str) -> Hostile:
    return Hostile(f"cfg-{name}", needle, text)


CONFIGS = [
    cfg("inf-spread", "not a finite number", "client:\n  start_spread_ms: .inf\n"),
    cfg("nan-budget", "not a finite number", "budget_ms: .nan\n"),
    cfg("neg-inf-silence", "not a finite number", "asr:\n  silence_ms: -.inf\n"),
    cfg(
        "inf-in-backend-spec",
        "not a finite number",
        "agent:\n  backend: {hardware: h100-sxm, model: llama-3.1-8b, tp: .inf}\n",
    ),
    cfg("uplink-1e12", "transport.uplink_ms", "transport:\n  uplink_ms: 1e12\n"),
    cfg("downlink-1e300", "transport.downlink_ms", "transport:\n  downlink_ms: 1.0e300\n"),
    cfg("silence-huge", "asr.silence_ms", "asr:\n  silence_ms: 1e9\n"),
    cfg("smart-huge", "asr.smart_incomplete_ms", "asr:\n  smart_incomplete_ms: 1e9\n"),
    cfg("spread-huge", "client.start_spread_ms", "client:\n  start_spread_ms: 1e12\n"),
    cfg("timeout-huge", "client.turn_timeout_s", "client:\n  turn_timeout_s: 1e9\n"),
    cfg("budget-huge", "budget_ms", "budget_ms: 1e15\n"),
    cfg("ttfb-huge-map", "tts.ttfb_ms.median", "tts:\n  ttfb_ms: {median: 1e12, p90: 1e12}\n"),
    cfg("ttfb-huge-scalar", "tts.ttfb_ms.median", "tts:\n  ttfb_ms: 1e12\n"),
    cfg("finalize-p90-huge", "asr.finalize_ms.p90", "asr:\n  finalize_ms: {median: 100, p90: 1e20}\n"),
    cfg("deadline-huge", "council.deadline_ms", "council:\n  deadline_ms: 1e12\n"),
    cfg("stable-huge", "router.preemptive.stable_ms", "router:\n  preemptive: {stable_ms: 1e10}\n"),
    cfg("classifier-huge", "router.classifier_ms", "router:\n  classifier_ms: 1e10\n"),
    cfg("lookup-huge", "cache.lookup_ms", "cache:\n  lookup_ms: 1e10\n"),
    cfg("stop-huge", "transport.stop_ms", "transport:\n  stop_ms: 1e10\n"),
    cfg("probe-warn-huge", "broker.probe_warn_ms", "broker:\n  probe_warn_ms: 1e10\n"),
    cfg("tts-wpm-tiny", "tts.words_per_minute", "tts:\n  words_per_minute: 1.0e-300\n"),
    cfg("client-wpm-tiny", "client.words_per_minute", "client:\n  words_per_minute: 0.0001\n"),
    cfg("tts-wpm-huge", "tts.words_per_minute", "tts:\n  words_per_minute: 1e9\n"),
    cfg("prompt-tokens-huge", "agent.prompt_tokens", "agent:\n  prompt_tokens: 1000000000000\n"),
    cfg("chunk-tokens-huge", "agent.chunk_tokens", "agent:\n  chunk_tokens: 1000000000\n"),
    cfg("capacity-huge", "cache.capacity", "cache:\n  capacity: 1000000000000\n"),
    cfg("max-tries-huge", "router.preemptive.max_tries", "router:\n  preemptive: {max_tries: 1000000}\n"),
    cfg("seed-huge", "seed", "seed: 1000000000000000000000000000000\n"),
    cfg("neg-downlink", "transport.downlink_ms", "transport:\n  downlink_ms: -1\n"),
    cfg("neg-silence", "asr.silence_ms", "asr:\n  silence_ms: -0.5\n"),
    cfg("neg-spread", "client.start_spread_ms", "client:\n  start_spread_ms: -100\n"),
    cfg("neg-barge", "tts.barge_in_detect_ms", "tts:\n  barge_in_detect_ms: -64\n"),
    cfg("neg-budget", "budget_ms", "budget_ms: -800\n"),
    cfg("neg-timeout", "client.turn_timeout_s", "client:\n  turn_timeout_s: -1\n"),
    cfg("zero-deadline", "council.deadline_ms", "council:\n  deadline_ms: 0\n"),
    cfg("unknown-top", "colour: unknown field", "colour: red\n"),
    cfg("unknown-nested", "asr.silense_ms: unknown field", "asr:\n  silense_ms: 100\n"),
    cfg("unknown-deep", "router.preemptive.enable: unknown field", "router:\n  preemptive: {enable: true}\n"),
    cfg("dup-nested", "duplicate key 'silence_ms'", "asr:\n  silence_ms: 1\n  silence_ms: 2\n"),
    cfg("dup-section", "duplicate key 'asr'", "asr: {}\nbudget_ms: 1\nasr: {}\n"),
    cfg("string-number", "budget_ms", "budget_ms: fast\n"),
    cfg("quoted-number", "budget_ms", "budget_ms: '800'\n"),
    cfg("bool-number", "budget_ms", "budget_ms: true\n"),
    cfg("bool-dist", "tts.ttfb_ms", "tts:\n  ttfb_ms: yes\n"),
    cfg("float-int", "agent.chunk_tokens", "agent:\n  chunk_tokens: 12.5\n"),
    cfg("list-section", "asr", "asr: [1, 2]\n"),
    cfg("null-section", "asr", "asr: null\n"),
    cfg("bad-literal", "asr.endpointing", "asr:\n  endpointing: psychic\n"),
    cfg("bad-qos", "broker.qos", "broker:\n  qos: 2\n"),
    cfg("p90-below-median", "tts.ttfb_ms", "tts:\n  ttfb_ms: {median: 200, p90: 100}\n"),
    cfg(
        "bomb-in-cache",
        "aliases",
        "cache:\n  entries:\n" + "".join("    " + ln for ln in BOMB.splitlines(True)),
    ),
    cfg(
        "too-many-cache-entries",
        "cache.entries",
        "cache:\n  entries: [&e {questions: [hi], answer: hello}, " + ",".join(["*e"] * 10_000) + "]\n",
    ),
    cfg(
        "cache-entry-shape", "cache.entries.0.questions", "cache:\n  entries: [{questions: [], answer: x}]\n"
    ),
    cfg("cache-entry-unknown", "cache.entries.0", "cache:\n  entries: [{q: 1}]\n"),
    cfg(
        "too-many-rules",
        "router.rules",
        "router:\n  policy: rules\n  rules: [&r {to: agent}, " + ",".join(["*r"] * 1000) + "]\n",
    ),
    cfg("empty-extra-name", "agent.extra", "agent:\n  extra: {'': cerebras-llama-3.1-8b}\n"),
    cfg("long-agent-name", "agent.name", "agent:\n  name: " + "x" * 1000 + "\n"),
    cfg("unknown-backend", "agent.backend", "agent:\n  backend: warp-drive\n"),
    cfg("bad-scheme", "broker.url", "broker:\n  url: http://example.com\n"),
    cfg("bad-port", "broker.url", "broker:\n  url: mqtt://user:hunter2secret@127.0.0.1:notaport\n"),
    cfg("ca-without-url", "broker.ca_file", "broker:\n  ca_file: /etc/hostname\n"),
    cfg(
        "ca-on-plain-mqtt",
        "broker.ca_file: TLS options need an mqtts://",
        "broker:\n  url: mqtt://127.0.0.1:1883\n  ca_file: /etc/hostname\n",
    ),
    cfg(
        "insecure-in-a-file",
        "broker.insecure: only the --insecure flag",
        "broker:\n  url: mqtts://127.0.0.1:8883\n  insecure: true\n",
    ),
    cfg(
        "missing-ca",
        "broker.ca_file",
        "broker:\n  url: mqtts://127.0.0.1:8883\n  ca_file: /nonexistent/ca.pem\n",
    ),
    cfg("ca-not-pem", "broker.ca_file", "broker:\n  url: mqtts://127.0.0.1:8883\n  ca_file: /etc/hostname\n"),
    cfg("missing-password-file", "broker.password_file", "broker:\n  password_file: /nonexistent/pw\n"),
    cfg("password-twice", "broker.password_file", "broker:\n  password: a\n  password_file: /etc/hostname\n"),
    cfg("url-too-long", "broker.url", "broker:\n  url: mqtt://" + "h" * 3000 + "\n"),
]


def scn(name: str, needle: str, text: str) -> Hostile:
    return Hostile(f"scn-{name}", needle, text)


SCENARIOS = [
    scn("comments-only", "name: Field required", "# nothing here\n# at all\n"),
    scn("turns-scalar", "turns", "name: x\nturns: 5\n"),
    scn("turns-empty", "turns", "name: x\nturns: []\n"),
    scn("no-reply", "turns.0.reply", "name: x\nturns:\n  - user: hi\n"),
    scn("reply-2mb", "bytes", "name: x\nturns:\n  - user: hi\n    reply: " + "word " * 400_000 + "\n"),
    scn("reply-20k", "turns.0.reply", "name: x\nturns:\n  - user: hi\n    reply: " + "word " * 4_000 + "\n"),
    scn("user-20k", "turns.0.user", "name: x\nturns:\n  - user: " + "word " * 4_000 + "\n    reply: ok\n"),
    scn("pause-no-duration", "turns.0.user: [pause] has no duration",
        "name: x\nturns:\n  - user: hi [pause] there\n    reply: ok\n"),
    scn("pause-unit-only", "turns.0.user: [pause ms] has no duration",
        "name: x\nturns:\n  - user: hi [pause ms] there\n    reply: ok\n"),
    scn("barge-in-pause-no-duration", "turns.0.barge_in: [Pause] has no duration",
        "name: x\nturns:\n  - user: hi\n    reply: ok\n    barge_in: wait [Pause] no\n"),
    scn("more-completions-than-pauses", "turns.0.complete_at_pauses: 2 entries but `user` has 1 pause",
        "name: x\nturns:\n  - user: hi [300] there\n    reply: ok\n    complete_at_pauses: [false, true]\n"),
    scn("pause-years", "turns.0.user", "name: x\nturns:\n  - user: hi [99999999999s] there\n    reply: ok\n"),
    scn(
        "pause-inf-digits",
        "turns.0.user",
        "name: x\nturns:\n  - user: hi [" + "9" * 400 + "] there\n    reply: ok\n",
    ),
    scn("barge-pause", "turns.0.barge_in", f"name: x\nturns:\n{TURN}    barge_in: wait [100000s]\n"),
    scn("gap-inf", "not a finite number", f"name: x\nturns:\n{TURN}    gap_ms: .inf\n"),
    scn("gap-huge", "turns.0.gap_ms", f"name: x\nturns:\n{TURN}    gap_ms: 1e12\n"),
    scn("gap-negative", "turns.0.gap_ms", f"name: x\nturns:\n{TURN}    gap_ms: -5\n"),
    scn("wpm-tiny", "turns.0.words_per_minute", f"name: x\nturns:\n{TURN}    words_per_minute: 0.001\n"),
    scn("wpm-huge", "turns.0.words_per_minute", f"name: x\nturns:\n{TURN}    words_per_minute: 1e9\n"),
    scn("barge-negative", "turns.0.barge_in_after_ms", f"name: x\nturns:\n{TURN}    barge_in_after_ms: -1\n"),
    scn("barge-nan", "not a finite number", f"name: x\nturns:\n{TURN}    barge_in_after_ms: .nan\n"),
    scn("gap-bool", "turns.0.gap_ms", f"name: x\nturns:\n{TURN}    gap_ms: true\n"),
    scn("gap-string", "turns.0.gap_ms", f"name: x\nturns:\n{TURN}    gap_ms: '400'\n"),
    scn(
        "too-many-turns",
        "turns",
        "name: x\nturns: [&t {user: hi, reply: ok}, " + ",".join(["*t"] * 1000) + "]\n",
    ),
    scn("bomb-in-turns", "aliases", BOMB + "name: x\nturns: *l8\n"),
    scn("dup-in-turn", "duplicate key 'reply'", f"name: x\nturns:\n{TURN}    reply: again\n"),
    scn("dup-name", "duplicate key 'name'", f"name: x\nname: y\nturns:\n{TURN}"),
    scn("unknown-in-turn", "turns.0.colour: unknown field", f"name: x\nturns:\n{TURN}    colour: red\n"),
    scn("unknown-top", "colour: unknown field", f"name: x\ncolour: red\nturns:\n{TURN}"),
    scn(
        "python-tag-name",
        "tag !!python/object/new:os.system",
        f"name: !!python/object/new:os.system [ls]\nturns:\n{TURN}",
    ),
    scn("int-name", "name", f"name: 12\nturns:\n{TURN}"),
    scn("empty-name", "name", f"name: ''\nturns:\n{TURN}"),
    scn("long-name", "name", "name: " + "x" * 1000 + f"\nturns:\n{TURN}"),
    scn("bad-complexity", "turns.0.complexity", f"name: x\nturns:\n{TURN}    complexity: extreme\n"),
    scn(
        "pauses-not-list",
        "turns.0.complete_at_pauses",
        f"name: x\nturns:\n{TURN}    complete_at_pauses: 'yes'\n",
    ),
    scn("intent-list", "turns.0.intent", f"name: x\nturns:\n{TURN}    intent: [a, b]\n"),
    scn("empty-user", "turns.0.user", "name: x\nturns:\n  - user: ''\n    reply: ok\n"),
    scn("pause-only-user", "turns.0.user", "name: x\nturns:\n  - user: '[500]'\n    reply: ok\n"),
    scn(
        "cache-no-questions",
        "cache.0.questions",
        f"name: x\nturns:\n{TURN}cache:\n  - questions: []\n    answer: a\n",
    ),
    scn(
        "cache-too-many",
        "cache",
        f"name: x\nturns:\n{TURN}cache: [&e {{questions: [hi], answer: a}}, "
        + ",".join(["*e"] * 10_000)
        + "]\n",
    ),
]


# JSON files voicepipe reads (a model's config.json, a `vllm bench serve` result): file-level problems and
# JSON ones. Each is refused by the file guard (voicepipe.files) before the reader looks at a field.
def _json(name: str, needle: str, text: str | bytes) -> Hostile:
    return Hostile(name, needle, text, suffix=".json")


JSON_FILES = [
    Hostile("directory", "is a directory", make=_dir),
    Hostile("fifo", "not a regular file (a FIFO)", make=_fifo),
    Hostile("char-device", "not a regular file (a character device)", make=_char_device),
    Hostile("missing", "no such file", make=lambda p: p.with_suffix(".json")),
    Hostile("sparse-1gb", "bytes", make=lambda p: _sparse(p, 1 << 30, ".json")),
    _json("deep-200k", "nested deeper than", "[" * 200_000 + "]" * 200_000),
    _json("deep-objects-150k", "nested deeper than", '{"a":' * 150_000 + "1" + "}" * 150_000),
    _json("deep-40", "nested deeper than", '{"a":' * 40 + "1" + "}" * 40),
    _json("huge-int", "too many digits", '{"num_hidden_layers": ' + "9" * 5000 + "}"),
    _json("syntax", "invalid JSON", '{"num_hidden_layers": 32,'),
    _json("not-utf8", "not UTF-8", b'{"a": "\xff\xfe"}'),
    _json("top-list", "top level must be", "[1, 2]"),
]

ALL_CONFIGS = [*FILE_LEVEL, *CONFIGS]
ALL_SCENARIOS = [*FILE_LEVEL, *SCENARIOS]
