"""A real OpenAI-compatible server for tests: llama.cpp's (``llama-cpp-python[server]``) serving a tiny
model file written here with ``gguf.GGUFWriter``.

The model is Llama-shaped (2 layers, 64-wide, 4 heads) with random weights: its replies are gibberish,
but the server does the real work of one — tokenising a chat template, prefill, decoding token by token,
streaming SSE — so timings and the protocol are real. The vocabulary is SentencePiece-style: the three
control tokens, 256 byte tokens spelled ``<0xNN>`` (so any text tokenises) and a few word pieces.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

N_EMBD, N_HEAD, N_FF, N_LAYER, N_CTX = 64, 4, 128, 2, 2048
WORDS = [
    "the",
    "a",
    "to",
    "and",
    "of",
    "you",
    "your",
    "coffee",
    "latte",
    "order",
    "please",
    "thanks",
    "yes",
    "no",
    "sure",
    "one",
    "two",
    "time",
    "open",
    "close",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def available() -> str | None:
    """None if the server and gguf can be imported, else why not."""
    for mod in ("llama_cpp", "gguf", "uvicorn", "sse_starlette"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[endpoint]')"
    return None


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + [f"▁{w}" for w in WORDS]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(WORDS)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(WORDS))]
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("voicepipe-tiny-test")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    t("token_embd.weight", n_vocab, N_EMBD)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    # output rows: word pieces 8x larger so replies are mostly words (with spaces: TTS gets clauses);
    # end-of-sequence never likelier than the rest, so replies run to max_tokens
    out = rng.standard_normal((n_vocab, N_EMBD)) * 0.05
    out[3 + 256 :] *= 8.0
    out[2] = 0.0
    w.add_tensor("output.weight", out.astype(np.float32))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{name}.weight", N_EMBD, N_EMBD)
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``python -m llama_cpp.server`` on a free loopback port, serving ``model`` under the name ``tiny``."""

    model_name = "tiny"

    def __init__(self, model: Path, log: Path, threads: int = 1) -> None:
        self.model, self.log_path, self.threads = model, log, threads
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(self.model),
            "--model_alias",
            self.model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            str(N_CTX),
            "--n_threads",
            str(self.threads),
            "--n_batch",
            "512",
            "--interrupt_requests",
            "False",
        ]  # fmt: skip  (queue concurrent requests, don't cut them off)
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/models", timeout=1) as r:
                if r.status == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(
            f"llama.cpp server not ready in {timeout_s} s: {self.log_path.read_text()[-2000:]}"
        )

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(Exception):
            self._log.close()
