"""Upper bounds on what a user file may ask for, and why each bound is where it is.

A scenario or config is input from whoever wrote the file. Without bounds a typo (``uplink_ms: 1e12``) or a
hostile file (``.inf``, an alias bomb, a 2 MB reply) makes a run sleep for years, time every turn out, or
make ``predict`` quadratic for hours. Every duration, rate, count and text here is bounded far beyond any
real voice conversation, so a legitimate file never meets a bound and an absurd one is refused at load
time with one line naming the file and the field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

# --- files (checked before parsing) -------------------------------------------------------------------
# The shipped scenarios are 1-3 KB. 256 KiB holds ~2,000 turns; libyaml parses it in ~0.1 s on a loaded
# 2-core box (pure-Python PyYAML ~1 s), so a rejection or a parse stays well inside a second.
MAX_FILE_BYTES = 256 * 1024
# a recorded turn (scenario `wav:`): 16 kHz mono s16 is 32 kB/s, so 24 MiB is ~13 minutes, past MAX_SPEECH_MS
MAX_WAV_BYTES = 24 * 1024 * 1024
# Values in a document after expanding every alias (an alias bomb is a few lines that expand to billions
# of values). The largest legitimate file (1,000 turns of ~10 values) holds ~10,000; counting stops at the
# bound, so refusing a bomb costs ~0.1 s.
MAX_YAML_VALUES = 100_000
# Nesting depth of a document; the deepest legitimate config is 5 levels (router.rules.N.when.intent).
MAX_YAML_DEPTH = 32
# A password file holds one line.
MAX_SECRET_BYTES = 4096
# A Hugging Face config.json: an LLM's is a few KB (dozens of scalar fields, a rope_scaling block, a
# text_config for multimodal ones). 1 MiB is hundreds of times that, and json parses it in milliseconds.
MAX_MODEL_JSON_BYTES = 1024 * 1024
# A `vllm bench serve --save-result` JSON: the summary is a few KB; with --save-detailed it also holds
# per-request lists (ttfts, itls per output token, generated texts): by estimate (1,000 prompts x 256 ITL
# floats of ~20 characters, plus the texts) ~6 MB for the default 1,000 prompts. 64 MiB holds ten times that.
MAX_BENCH_JSON_BYTES = 64 * 1024 * 1024
# voicepipe's own CSV/OTLP exports read back (report.export.read_csv/read_otel): ~1-2 KB per turn, so
# 64 MiB is tens of thousands of turns, far past MAX_TURNS x a few hundred sessions.
MAX_EXPORT_BYTES = 64 * 1024 * 1024
# A PEM CA bundle, client certificate or key: Debian's whole system bundle (ca-certificates.crt) is ~220 KB
# (144 certificates here); 4 MiB is over fifteen times that.
MAX_PEM_BYTES = 4 * 1024 * 1024
# Nesting depth of a JSON document: HF configs nest 3 levels (text_config.rope_scaling.x), vLLM results 3
# (itls: a list of lists). Python's json parser recurses per level, so a 200,000-deep document would
# exhaust its stack: anything deeper than this is refused as one line.
MAX_JSON_DEPTH = 32

# --- durations ---------------------------------------------------------------------------------------
# Any one modelled or scripted duration (a stage, a pause, a gap): the turn budget is 800 ms and the
# longest published waits are seconds (Smart Turn's 3 s fallback), so a minute is far past any voice turn.
MAX_MS = 60_000.0
# How long the client waits for one turn before recording a timeout (default 20 s).
MAX_TURN_TIMEOUT_S = 600.0
# Spreading session starts over more than ten minutes is no longer a burst test.
MAX_SPREAD_MS = 600_000.0

# --- rates -------------------------------------------------------------------------------------------
# Speaking rates: conversational English is ~120-180 words per minute, audiobooks ~150-160 and fast
# speech rarely passes 300. Below 20 wpm a single word takes 3 s; above 1,000 a 10-word reply is 0.6 s.
MIN_WPM = 20.0
MAX_WPM = 1000.0

# --- counts ------------------------------------------------------------------------------------------
# Prompt tokens before the first turn: the largest context windows offered are ~2M tokens (Gemini 1.5
# Pro, https://ai.google.dev/gemini-api/docs/long-context).
MAX_PROMPT_TOKENS = 2_000_000
MAX_CHUNK_TOKENS = 10_000
MAX_CACHE_ENTRIES = 10_000  # config or scenario cache entries (GPTCache's default LRU holds 1,000)
MAX_CACHE_CAPACITY = 1_000_000
MAX_LIST = 1_000  # rules, council members, keyword lists, pause annotations, questions per cache entry
MAX_TURNS = 1_000  # turns in one scenario: ~1,000 turns is hours of real-time conversation
MAX_TRIES = 100  # preemptive generation tries per turn (LiveKit uses at most 3)
MAX_WORDS = 100_000

# --- text --------------------------------------------------------------------------------------------
# One utterance or reply: 10,000 characters is ~1,700 words, about ten minutes of speech at 165 wpm. The
# bound matters: TTS clause chunking is quadratic in words when a reply has no punctuation; at this bound
# ``predict`` spends ~0.1 s on such a reply, a 2 MB one took over ten minutes (issue 12).
MAX_TEXT = 10_000
# One utterance, reply or cached answer as spoken: ten minutes (MAX_TEXT's ~1,700 words at 165 wpm). Text
# within MAX_TEXT can still take longer at a slow speaking rate (5,000 one-letter words at 20 wpm are over
# four hours), and the speaking rates live in the config, so this is checked when a scenario meets its
# config (voicepipe.config.check_speech; a config's own cache answers when it loads). The bus guard's
# bound on an audio chunk is this one (voicepipe.stages.guard.MAX_AUDIO_MS), so no message of a run that
# passed the check is ever refused as out of range.
MAX_SPEECH_MS = 600_000.0
# A run id is part of every MQTT topic (voicepipe/RUN/...): letters, digits, "-", "_", "." only (no "/",
# "+", "#" or "$", which MQTT reads as levels, wildcards and system topics), and at most 64 characters: the
# default is 8 hex digits, and the id is also printed in table titles and log lines.
MAX_RUN_ID = 64
MAX_NAME = 200  # scenario, agent and intent names; they end up in MQTT topics and table columns
MAX_URL = 2_048
MAX_SEED = 2**63 - 1

# --- bounded field types for the config and scenario models ------------------------------------------
Ms = Annotated[float, Field(ge=0, le=MAX_MS)]  # one modelled or scripted duration
Wpm = Annotated[float, Field(ge=MIN_WPM, le=MAX_WPM)]  # a speaking rate
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
