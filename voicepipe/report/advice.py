"""What would fix the misses: the largest part of the missed turns, and the change that shrinks it most.

Model: take the turns that missed the budget, average their breakdown per ``(stage, what)`` part, and pick
the largest. Each stage has a small set of concrete changes that act on it (a faster LLM backend for
``agent``/``council``; smart endpointing for ``asr``; on-device audio (the shipped fast-lane config) for
``transport``; the pre-rendered answer cache for ``tts``). Every candidate is *predicted* with the
virtual-time predictor (:func:`voicepipe.predict.predict`, no live run) on the same scenarios, and the one with the
most turns within budget (then the lowest p50) that beats the current prediction is named, with its
predicted numbers and the command that runs it. Nothing here is canned: a part or a candidate that does
not help is never suggested; when none helps, the line says so.

Used by ``voicepipe run`` / ``predict`` (one line at the end) and the HTML report's "what would fix the
misses" panel (:func:`advice`).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console

from voicepipe.backends import empirical_names
from voicepipe.config import PipelineConfig, apply_set, check_speech, load_config
from voicepipe.errors import UserError
from voicepipe.files import read_yaml_mapping
from voicepipe.predict import predict
from voicepipe.records import TurnRecord, summarise
from voicepipe.scenario import load_scenario
from voicepipe.shipped import configs_dir, short_name


@dataclass(frozen=True)
class Candidate:
    what: str  # human words: "a faster LLM backend (groq-llama-3.1-8b)"
    config: str | None  # a config file replacing the user's (None: keep theirs)
    sets: tuple[str, ...]  # --set overrides


@dataclass(frozen=True)
class Advice:
    missed: int
    turns: int
    budget_ms: float
    part: tuple[str, str]  # (stage, what) of the largest part on missed turns
    part_ms: float  # its mean over missed turns
    total_ms: float  # mean latency of the missed turns (answered ones)
    fix: Candidate | None
    fix_p50_ms: float | None = None
    fix_within: float | None = None
    now_p50_ms: float | None = None
    now_within: float | None = None
    command: str | None = None
    talked_over: int = 0  # missed turns on which the agent talked over the user (then ``part`` is the ASR's)
    uncertain: int = 0  # of the missed: within budget only at their range's fast end (predictions)

    def text(self) -> str:
        """The finding and the predicted effect of the fix, as prose (the command is :attr:`command`)."""
        st, wh = self.part
        if self.talked_over:
            head = (
                f"next step: {self.missed}/{self.turns} turns missed; on {self.talked_over} of them the agent "
                f"talked over the user (the endpoint came mid-sentence: {st} {wh} {self.part_ms:,.0f} ms)"
            )
        else:
            unsure = f" ({self.uncertain} of them uncertain)" if self.uncertain else ""
            head = (
                f"next step: {self.missed}/{self.turns} turns missed {self.budget_ms:.0f} ms{unsure}; the largest "
                f"part of them is {st} {wh} ({self.part_ms:,.0f} ms of {self.total_ms:,.0f} ms on average)"
            )
        if self.fix is None:
            return head + "; no shipped change to it predicts fewer misses."
        return (
            f"{head}. Try {self.fix.what} — predicted p50 {self.fix_p50_ms:,.0f} ms, "
            f"{self.fix_within:.0%} within budget (now predicted {self.now_p50_ms:,.0f} ms, "
            f"{self.now_within:.0%}; modelled):"
        )

    def line(self) -> str:
        """Prose and command on one line (logs, JSON-mode stderr)."""
        return self.text() + (f" {self.command}" if self.fix is not None and self.command else "")


def print_advice(console: Console, a: Advice) -> None:
    """The prose wrapped at the console width, then the command alone on a line (never wrapped, so it
    copies whole)."""
    console.print(a.text(), highlight=False, markup=False)
    if a.fix is not None and a.command:
        console.print(f"  {a.command}", highlight=False, markup=False, soft_wrap=True)


def shipped_configs() -> Path:
    return configs_dir()


def largest_part(records: Sequence[TurnRecord]) -> tuple[tuple[str, str], float, float] | None:
    """((stage, what), mean ms, mean total ms) of the largest breakdown part over the answered records."""
    answered = [r for r in records if r.measured_ms is not None]
    if not answered:
        return None
    sums: dict[tuple[str, str], float] = {}
    for r in answered:
        for p in r.breakdown:
            sums[(p.stage, p.what)] = sums.get((p.stage, p.what), 0.0) + p.ms
    if not sums:
        return None
    key = max(sums, key=lambda k: sums[k])
    total = sum(r.measured_ms or 0.0 for r in answered) / len(answered)
    return key, sums[key] / len(answered), total


def _backend_names() -> list[str]:
    """LLM backends to try: the empirical profiles and the hardware shorthands the shipped configs use."""
    names = set(empirical_names())
    for p in sorted(shipped_configs().glob("*.yaml")):
        try:
            data = read_yaml_mapping(p)
        except UserError:
            continue
        agent = data.get("agent")
        if isinstance(agent, dict) and isinstance(agent.get("backend"), str):
            names.add(agent["backend"])
    return sorted(names)


def candidates(stage: str, cfg: PipelineConfig, talked_over: bool = False) -> list[Candidate]:
    """Concrete changes that act on ``stage`` (never the one already in place); ``talked_over``: the misses
    are premature endpoints, so the endpoint must wait longer, not less."""
    out: list[Candidate] = []
    if talked_over:
        if cfg.asr.endpointing != "smart":
            out.append(Candidate("smart endpointing", None, ("asr.endpointing=smart",)))
        longer = max(500.0, cfg.asr.silence_ms * 2)
        out.append(Candidate(f"a longer silence wait ({longer:g} ms)", None,
                             ("asr.endpointing=silence", f"asr.silence_ms={longer:g}")))  # fmt: skip
        return out
    fast_lane = shipped_configs() / "fast-lane.yaml"
    if stage in ("agent", "council"):
        for name in _backend_names():
            if name != cfg.agent.backend:
                out.append(Candidate(f"a faster LLM backend ({name})", None, (f"agent.backend={name}",)))
        if stage == "council":
            out.append(Candidate("the single agent instead of the council", None, ("router.policy=single",)))
    elif stage == "asr":
        if cfg.asr.endpointing != "smart":
            out.append(Candidate("smart endpointing", None, ("asr.endpointing=smart",)))
        out.append(Candidate("a shorter silence wait (150 ms)", None, ("asr.silence_ms=150",)))
    elif stage == "tts" and not (cfg.cache.enabled and cfg.router.cache_first):
        out.append(
            Candidate(
                "the answer cache with pre-rendered audio",
                None,
                ("cache.enabled=true", "router.cache_first=true"),
            )
        )
    if stage in ("transport", "tts", "bus", "asr", "agent") and fast_lane.is_file():
        out.append(Candidate("the fast-lane config (on-device audio, smart endpointing, cache, SRAM 8B)",
                             str(fast_lane), ()))  # fmt: skip
    return out


def _flags(c: Candidate) -> list[str]:
    parts: list[str] = []
    if c.config is not None:
        parts += ["-c", _display_path(c.config)]
    for s in c.sets:
        parts += ["--set", s]
    return parts


def _display_path(p: str) -> str:
    if (name := short_name(p)) is not None:
        return name  # a shipped config goes by its name from any folder
    try:
        return str(Path(p).resolve().relative_to(Path.cwd()))
    except ValueError:
        return p


def _alternative(cfg: PipelineConfig, c: Candidate) -> PipelineConfig:
    """``cfg`` with the candidate applied: its config file instead (with cfg's budget and seed), or its
    ``--set`` overrides on top of cfg."""
    if c.config is not None:
        return load_config(c.config, [f"budget_ms={cfg.budget_ms}", f"seed={cfg.seed}", *c.sets])
    data = cfg.model_dump(mode="python")
    for s in c.sets:
        apply_set(data, s)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError("advice", str(exc)) from None


def advice(
    records: Sequence[TurnRecord],
    cfg: PipelineConfig,
    scenarios: Sequence[str],
    base_command: Sequence[str] | None = None,
) -> Advice | None:
    """The largest part of the missed turns and the best predicted change to it; None when none missed.

    ``base_command`` is how the user ran this configuration (e.g. ``voicepipe run cafe-order -c my.yaml``);
    the suggested command is it plus the change. Without it, only the change's flags are shown."""
    missed = [r for r in records if not r.within_budget]
    if not missed:
        return None
    found = largest_part(missed)
    if found is None:
        return None
    part, part_ms, total = found
    talked = sum(r.talked_over for r in missed)
    if talked * 2 >= len(missed):  # mostly premature endpoints: the endpointing is what to change
        talked_recs = [r for r in missed if r.talked_over]
        part = ("asr", "endpoint wait")
        part_ms = sum(p.ms for r in talked_recs for p in r.breakdown if (p.stage, p.what) == part) / len(talked_recs)
    else:
        talked = 0
    unsure = sum(r.uncertain for r in missed)
    base = Advice(len(missed), len(records), cfg.budget_ms, part, part_ms, total, None, talked_over=talked,
                  uncertain=unsure)  # fmt: skip
    try:
        scs = [load_scenario(s) for s in scenarios]
        now = summarise(p.as_record() for p in predict(cfg, scs))
    except (UserError, ValueError):
        return base
    best: tuple[Candidate, float, float] | None = None
    for c in candidates(part[0], cfg, talked_over=bool(talked)):
        try:
            alt = _alternative(cfg, c)
            check_speech(alt, scs)  # a candidate's own speaking rate can make a line too long to say
            s = summarise(p.as_record() for p in predict(alt, scs))
        except (UserError, ValueError):
            continue
        if s.p50_ms is None or now.p50_ms is None:
            continue
        better = (s.within_budget, -s.p50_ms) > (now.within_budget, -now.p50_ms) and (
            s.p50_ms < now.p50_ms or bool(talked)  # waiting longer to stop talking over the user costs latency
        )
        if better and (best is None or (s.within_budget, -s.p50_ms) > (best[2], -best[1])):
            best = (c, s.p50_ms, s.within_budget)
    if best is None:
        return base
    c, p50, within = best
    cmd = list(base_command or [])
    if c.config is not None:  # the candidate's config replaces the user's file and overrides
        cmd = cmd[: next((i for i, a in enumerate(cmd) if a.startswith("-")), len(cmd))]
        default = PipelineConfig()
        cmd += [f"--set=budget_ms={cfg.budget_ms:g}"] if cfg.budget_ms != default.budget_ms else []
        cmd += [f"--set=seed={cfg.seed}"] if cfg.seed != default.seed else []
    cmd = _without_keys(cmd, {s.partition("=")[0] for s in c.sets})
    return Advice(
        base.missed, base.turns, base.budget_ms, part, part_ms, total, c, p50, within,
        now.p50_ms, now.within_budget, shlex.join([*cmd, *_flags(c)]), talked, unsure,
    )  # fmt: skip


def _without_keys(cmd: list[str], keys: set[str]) -> list[str]:
    """``cmd`` without its ``--set K=V`` / ``--set=K=V`` overrides of ``keys`` (the change sets them anew)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(cmd):
        if skip:
            skip = False
            continue
        if a == "--set" and i + 1 < len(cmd) and cmd[i + 1].partition("=")[0] in keys:
            skip = True
            continue
        if a.startswith("--set=") and a.removeprefix("--set=").partition("=")[0] in keys:
            continue
        out.append(a)
    return out


def base_command(
    cmd: str, scenarios: Sequence[str], config: str | Path | None, sets: Sequence[str]
) -> list[str]:
    """The command line that reproduces a run: ``voicepipe CMD SCENARIOS [-c CONFIG] [--set ...]``."""
    out = ["voicepipe", cmd, *scenarios]
    if config is not None:
        out += ["-c", _display_path(str(config))]
    for s in sets:
        out += ["--set", s]
    return out
