"""Propose provenance for the points of data/validation.yaml from each point's source URL and notes.

A one-off data tool (issue 24, item 2), kept so the proposal can be re-read and re-run: the publisher (who
published the figure; for a vendor or framework the organisation, so all of its docs and blogs are one
family), ``publisher_family``, ``speculative``, ``engine``, ``engine_version`` and ``timing``, each from a
rule over the URL's domain/repository and the notes' wording. Nothing is inferred that the source does not
state: a field no rule settles stays absent (None / ""). ``--write`` inserts the proposed fields into the
file (before each point's ``notes``; a point that already states a field keeps it), otherwise the proposal
is printed as a table for review.

    python bench/propose_provenance.py            # review
    python bench/propose_provenance.py --write    # apply
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

FILE = Path(__file__).resolve().parents[1] / "voicepipe" / "hardware" / "data" / "validation.yaml"

# (pattern on the source URL, publisher, family); first match wins. Vendor: makes the machine measured;
# framework: maintains the serving stack measured; independent: neither.
PUBLISHERS: list[tuple[str, str, str]] = [
    (r"github\.com/NVIDIA/|developer\.nvidia\.com|docs\.nvidia\.com", "NVIDIA", "vendor"),
    (r"github\.com/ROCm/|www\.amd\.com", "AMD", "vendor"),
    (r"intel\.com", "Intel", "vendor"),
    (r"github\.com/AI-Hypercomputer/", "Google (AI-Hypercomputer)", "vendor"),
    (r"github\.com/InternLM/lmdeploy", "InternLM (LMDeploy maintainers)", "framework"),
    (r"github\.com/mlc-ai/", "MLC (mlc-ai maintainers)", "framework"),
    (r"github\.com/pytorch-labs/gpt-fast", "PyTorch (gpt-fast maintainers)", "framework"),
    (r"github\.com/casper-hansen/AutoAWQ", "Casper Hansen (AutoAWQ maintainer)", "framework"),
    (r"github\.com/ggml-org/llama\.cpp", "llama.cpp (contributors' PR measurements)", "framework"),
    (r"github\.com/vllm-project/|buildkite\.com/vllm", "vLLM (project maintainers)", "framework"),
    (r"lmsys\.org", "LMSYS (SGLang maintainers)", "framework"),
    (r"github\.com/XiongjieDai/", "Xiongjie Dai (GPU-Benchmarks-on-LLM-Inference)", "independent"),
    (r"github\.com/argonne-lcf/", "Argonne National Laboratory (LLM-Inference-Bench, arXiv 2411.00136)", "independent"),
    (r"github\.com/dstackai/", "dstack (dstackai/benchmarks)", "independent"),
    (r"github\.com/datacrunch-research/", "DataCrunch (datacrunch-research/h200-benchmarks)", "independent"),
    (r"github\.com/gpustack/", "GPUStack (gpustack/gpustack docs)", "independent"),
    (r"blogs\.oracle\.com", "Oracle Cloud Infrastructure (blog)", "independent"),
    (r"sambanova\.ai|conference-program\.com", "SambaNova", "vendor"),
]
# MLPerf results: the submitter the notes name (the harness is the submitter's)
SUBMITTERS = [
    (r"Intel-HabanaLabs", "Intel", "vendor"),
    (r"\bAMD\b", "AMD", "vendor"),
    (r"Fujitsu", "Fujitsu (MLPerf submitter, NVIDIA's harness)", "vendor"),
    (r"NVIDIA", "NVIDIA", "vendor"),
]
# the relayed SRAM figures already carry a publisher: rewritten so its name (before " (") is the party
# whose figure it is, the relay kept in brackets
RENAMED = {
    "TechPowerUp (relaying Groq's figures)": "Groq (relayed by TechPowerUp)",
    "Tom's Hardware (reporting Cerebras' announcement)": "Cerebras (announcement reported by Tom's Hardware)",
    "SambaNova blog quoting Artificial Analysis": "Artificial Analysis (quoted by SambaNova's blog)",
    "dreaming.press quoting Artificial Analysis": "Artificial Analysis (quoted by dreaming.press)",
    "hivebook.wiki quoting Groq's pricing page": "Groq (pricing page, quoted by hivebook.wiki)",
    "AITechSuite reporting Cerebras press release (measured by Artificial Analysis)": (
        "Artificial Analysis (Cerebras press release reported by AITechSuite)"
    ),
    "SemiAnalysis Tokenomics (from the Artificial Analysis Cerebras provider page)": (
        "Artificial Analysis (Cerebras provider page, via SemiAnalysis Tokenomics)"
    ),
    "AnIntent blog quoting Cerebras (Artificial Analysis figures)": (
        "Artificial Analysis (figures quoted by the AnIntent blog via Cerebras)"
    ),
}
ENGINES = {
    "trtllm": "tensorrt-llm", "trtllm-v0.6": "tensorrt-llm", "trtllm-max-util": "tensorrt-llm",
    "vllm": "vllm", "vllm-v0": "vllm", "sglang": "sglang", "lmdeploy": "lmdeploy", "lmdeploy-v0.1": "lmdeploy",
    "llama.cpp": "llama.cpp", "mlc": "mlc-llm", "gpt-fast": "gpt-fast", "autoawq": "autoawq", "tgi": "tgi",
    "jetstream": "jetstream-pytorch", "gaudi-pytorch": "optimum-habana", "nim": "nim", "deepspeed": "deepspeed-mii",
    "cerebras": "cerebras", "groq": "groq", "sambanova": "sambanova",
}  # fmt: skip
# a version the notes state next to the engine's name
VERSION = re.compile(
    r"(?:TensorRT-LLM|TRT-LLM|vLLM|SGLang|LMDeploy|NIM|llama\.cpp|TGI|TensorRT|version)\s*\(?v?(\d+\.\d+(?:\.\d+)?(?:\.post\d+|rc\d+)?)",
    re.I,
)
# how the notes say the figure was timed: a benchmark client over HTTP, or the engine's own benchmark
CLIENT = re.compile(
    r"benchmark_serving|bench_serving|bench_one_batch_server|genai-perf|llmperf|OpenAI-compatible|OpenAI API|"
    r"--max-concurrency|"
    r"request[- ]rate|QPS|Poisson|online serving|tensorrtllm_backend",
    re.I,
)
# the engine's own benchmark tools name the timing whatever else the notes say (trtllm-bench "at infinite
# request rate" is not a client); then a client's words; then weaker hints of an in-process run
TOOL = re.compile(
    r"trtllm-bench|gptSessionBenchmark|gptManagerBenchmark|benchmark_throughput|benchmark_latency|llama-bench|"
    r"bench_one_batch\b|profile_generation|profile_throughput",
    re.I,
)
ENGINE = re.compile(r"MLPerf|Offline scenario|generate\.py|benchmark\.py|offline", re.I)
SPEC = re.compile(r"\bMTP\b[^.;]*?\((\d+)[^)]*\)", re.I)


def propose(p: dict) -> dict[str, object]:
    """The provenance fields a point's URL and notes settle (absent: not settled)."""
    src, notes = p["source"], p.get("notes") or ""
    out: dict[str, object] = {}
    if p.get("publisher"):
        out["publisher"] = RENAMED.get(p["publisher"], p["publisher"])
    elif "mlcommons" in src:
        for pat, name, fam in SUBMITTERS:
            if re.search(pat, notes):
                out["publisher"], out["publisher_family"] = name, fam
                break
    else:
        for pat, name, fam in PUBLISHERS:
            if re.search(pat, src):
                out["publisher"], out["publisher_family"] = name, fam
                break
    if out.get("publisher_family") == "framework" and p["stack"] == "mlc" and "lmdeploy" in src:
        out["publisher_family"] = "independent"  # LMDeploy's maintainers measuring another stack
    m = SPEC.search(notes)
    if m:
        out["speculative"] = f"mtp gamma={m.group(1)}"
    elif re.search(r"speculative_config=None|no speculative|without speculative", notes, re.I):
        out["speculative"] = "none"
    if p["stack"] in ENGINES:
        out["engine"] = ENGINES[p["stack"]]
    v = VERSION.search(notes)
    if v:  # MLPerf rows state TensorRT's version, not TensorRT-LLM's: said so
        out["engine_version"] = ("TensorRT " if re.match(r"TensorRT\s", v.group(0)) else "") + v.group(1)
    if "mlcommons" in src or TOOL.search(notes):  # MLPerf's LoadGen drives the harness in process
        out["timing"] = "engine"
    elif CLIENT.search(notes) or re.search(r"\bHTTP\b", notes):
        out["timing"] = "client"
    elif ENGINE.search(notes):
        out["timing"] = "engine"
    return out


def _yaml_value(v: object) -> str:
    return yaml.safe_dump(v, default_style=None, width=10_000).strip().removesuffix("\n...").strip()


def write(text: str, proposals: dict[str, dict[str, object]]) -> str:
    """The file with each point's proposed fields inserted before its ``notes`` (stated fields win, a
    renamed publisher replaces its line)."""
    lines = text.split("\n")
    out: list[str] = []
    current: str | None = None
    have: set[str] = set()
    for line in lines:
        m = re.match(r"  - id: (.+)$", line)
        if m:
            current, have = m.group(1).strip().strip("'\""), set()
        f = re.match(r"    (\w+): ", line)
        if current and f:
            have.add(f.group(1))
            if f.group(1) == "publisher" and "publisher" in proposals.get(current, {}):
                line = f"    publisher: {_yaml_value(proposals[current]['publisher'])}"
            if f.group(1) == "notes":
                for k, v in proposals.get(current, {}).items():
                    if k not in have:
                        out.append(f"    {k}: {_yaml_value(v)}")
        out.append(line)
    return "\n".join(out)


def main() -> None:
    data = yaml.safe_load(FILE.read_text())["points"]
    proposals = {p["id"]: propose(p) for p in data}
    if "--write" in sys.argv:
        FILE.write_text(write(FILE.read_text(), proposals))
        return
    for p in data:
        print(p["id"], proposals[p["id"]])


if __name__ == "__main__":
    main()
