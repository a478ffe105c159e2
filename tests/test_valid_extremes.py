"""Valid input at its extremes: any config and scenario the loaders accept (within every bound) runs on
virtual time with every turn answered and none of the run's own messages refused by the bus guard.

Found this way (a fuzz over bounded values): a lognormal with median 0.001 ms and the default p90 drew
hours (now capped at MAX_MS), and a 2,000-word reply made a 12-minute audio chunk (now a speech bound and
a TTS clause cap). The default run draws a few dozen combinations; ``-m slow`` draws many more.
"""

from __future__ import annotations

import json
import random

import pytest

from voicepipe.config import check_speech, load_config
from voicepipe.errors import UserError
from voicepipe.limits import MAX_MS, MAX_WPM, MIN_WPM
from voicepipe.runner import simulate
from voicepipe.scenario import load_scenario
from voicepipe.text import PAUSE

MS = [0, 0.001, 1, 50, 800, 5000, MAX_MS]
SETTINGS = {
    "budget_ms": [1, 800, MAX_MS],
    "transport.uplink_ms": MS,
    "transport.downlink_ms": MS,
    "transport.stop_ms": MS,
    "asr.endpointing": ["silence", "smart"],
    "asr.silence_ms": MS,
    "asr.smart_incomplete_ms": MS,
    "asr.smart_source": ["annotation", "heuristic"],
    "asr.finalize_ms.median": [0.001, 1, 100, 5000],
    "router.policy": ["single", "rules", "classifier", "preemptive"],
    "router.default": ["agent", "cache", "council"],
    "router.classifier_low": ["cache", "agent", "council"],
    "router.cache_first": [True, False],
    "router.preemptive.enabled": [True, False],
    "router.preemptive.stable_ms": MS,
    "router.preemptive.max_tries": [1, 3, 100],
    "agent.prompt_tokens": [1, 1000, 2_000_000],
    "agent.chunk_tokens": [1, 12, 10_000],
    "agent.backend": ["sonnet-gpu", "groq-llama-3.1-8b", "h100-sxm/llama-3.1-8b", "cerebras-wse3/llama-3.1-8b",
                      "rtx-4090/gpt-oss-20b", "b200/gemma-3-27b"],
    "tts.ttfb_ms.median": [0.001, 188, 5000],
    "tts.aggregate": ["clause", "sentence"],
    "tts.min_clause_words": [1, 3, 1000],
    "tts.words_per_minute": [MIN_WPM, 165, MAX_WPM],
    "cache.enabled": [True, False],
    "cache.threshold": [0, 0.5, 1],
    "cache.capacity": [0, 1, 1_000_000],
    "council.aggregation": ["first", "vote", "judge", "draft-refine"],
    "council.k": [1, 2, 1000],
    "council.deadline_ms": MS,
    "client.playout": ["full", "first_audio"],
    "client.words_per_minute": [MIN_WPM, 150, MAX_WPM],
}  # fmt: skip
COUNCIL = ["council.members=[groq-lpu/llama-3.1-8b,cerebras-wse3/llama-3.1-8b,h100-sxm/llama-3.1-8b]",
           "council.judge=groq-lpu/llama-3.1-8b"]  # fmt: skip
WORDS = ["hi", "yes", "please", "coffee", "extraordinarily", "x", "can't", "€5", "naïve", "日本", "uh", "—"]
PUNCT = ["", "", ",", ".", "?", "!", "…"]
PAUSES = ["[300]", "[pause 900ms]", "[1.2s]", "[0]", "[59999]"]


def draw_line(rng: random.Random, most: int, pauses: bool = False) -> str:
    out = []
    for _ in range(rng.randint(1, most)):
        out.append(rng.choice(WORDS) + rng.choice(PUNCT))
        if pauses and rng.random() < 0.1:
            out.append(rng.choice(PAUSES))
    return " ".join(out)


def draw_case(rng: random.Random) -> tuple[dict, list[str]]:
    """One scenario and its --set list: each field at a bound, a default or in between."""
    turns = []
    for _ in range(rng.randint(1, 4)):
        t: dict = {"user": draw_line(rng, 40, pauses=True), "reply": draw_line(rng, 120)}
        for key, values in (("words_per_minute", [MIN_WPM, 150, MAX_WPM]), ("gap_ms", [0, 400, MAX_MS]),
                            ("intent", ["order", "faq"]), ("complexity", ["low", "high"]),
                            ("barge_in_after_ms", [0, 100, 5000])):  # fmt: skip
            if rng.random() < 0.25:
                t[key] = rng.choice(values)
        if rng.random() < 0.2:
            pauses = len(PAUSE.findall(t["user"]))  # at most one entry per pause (more is an error)
            t["complete_at_pauses"] = [rng.random() < 0.5 for _ in range(rng.randint(0, pauses))]
        turns.append(t)
    sets = [f"{k}={rng.choice(SETTINGS[k])}" for k in rng.sample(sorted(SETTINGS), rng.randint(0, 8))]
    if rng.random() < 0.3:
        sets += COUNCIL
    sets += ["client.turn_timeout_s=600", f"seed={rng.randrange(2**31)}"]
    return {"name": "edge", "turns": turns}, sets


def run_cases(tmp_path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(n):
        scenario, sets = draw_case(rng)
        path = tmp_path / "edge.yaml"
        path.write_text(json.dumps(scenario))  # JSON is YAML
        try:
            cfg = load_config(None, sets)
            sc = load_scenario(str(path))
            check_speech(cfg, [sc])
        except UserError:
            continue  # refused in one line: fine (the bad-file tests check the line)
        res = simulate(cfg, [sc], 2)
        case = f"case {i} of random.Random({seed}): --set {' '.join(sets)}; scenario {json.dumps(scenario)[:400]}"
        assert res.stage_errors == 0 and res.deadletters == 0, (
            res.first_error,
            dict(res.counters.dead),
            case,
        )
        assert len(res.records) == 2 * len(sc.turns), case
        assert all(r.predicted_ms is not None for r in res.records), ([r.status for r in res.records], case)


def test_valid_extremes_run_clean(tmp_path):
    run_cases(tmp_path, 60, seed=20261201)


@pytest.mark.slow
def test_valid_extremes_run_clean_many(tmp_path):
    run_cases(tmp_path, 3000, seed=1)
