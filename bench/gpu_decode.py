"""Measure decode steps and short-prompt TTFT of random-weight Llama-shaped decoders beside the model.

Weights' values don't change speed, so random weights of the published shapes stand in for the real
checkpoints. Each batch size decodes against a KV cache of ``--context`` tokens; on CUDA the decode step
is captured in a CUDA graph (as serving engines do) so the timing is the GPU's, not Python's. The
prefill (TTFT) runs eagerly, as serving stacks run it.

Weight formats (``--weights``):

* ``bf16`` — plain bf16 matmuls;
* ``fp8``  — W8A8 with per-tensor scales through ``torch._scaled_mm`` (native FP8 tensor cores on
  Hopper/Blackwell); the model side is ``--precision fp8`` (native on h200-sxm);
* ``int4`` — weight-only int4 (group 128) through ``torch._weight_int4pack_mm`` (the tinygemm kernel
  gpt-fast uses); the model side is ``--precision int4`` (weight-only: dequantised in the kernel).

A format the installed torch or device cannot run is reported as a row saying so, not skipped silently.

    python bench/gpu_decode.py --quick                           # H200, < 5 min: TP1 bf16/fp8/int4
    python bench/gpu_decode.py                                   # H200: 1B and 8B, batches 1..64
    python bench/gpu_decode.py --quick --dry-run                 # CPU, no torch needed: print the plan
    python bench/gpu_decode.py --shape tiny --device cpu --batches 1,2 --steps 3   # smoke test

``--quick`` is the check a session with a GPU runs: 1B and 8B shapes on one chip (TP 1), bf16, fp8 and
int4 decode at batch 1 and 8, and the eager TTFT of 16- and 128-token prompts, 20 timed steps each; it
stops starting new rows after ``--budget-s`` seconds (default 270 with ``--quick``) so the whole run fits
in five minutes, and says which rows it skipped. The JSON records the device, torch version, wall time
and every row (measured with CUDA events over the timed steps, after warm-up).

The "model" columns come from ``voicepipe.hardware.model`` for ``--hardware`` (the numbers of
``voicepipe hardware predict --hardware h200-sxm --model llama-3.1-8b --batch B --precision P``):
"kernel" uses the ``none`` stack (a bare CUDA-graphed loop, no server), "serving" the default stack.
Rotary embeddings and sampling are omitted (a few percent of a step). Results go to
``bench/results/gpu_decode.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voicepipe.hardware import catalog
from voicepipe.hardware import model as hm

FORMATS = ("bf16", "fp8", "int4")
QUICK_BUDGET_S = 270.0  # --quick starts no row after this, so the run (torch import included) fits 5 min
INT4_GROUP = 128


@dataclass(frozen=True)
class Shape:
    catalog_name: str | None
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


SHAPES = {
    # intermediate sizes from the same config.json files as the catalog (see data/models.yaml sources)
    "1b": Shape("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256),
    "8b": Shape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "tiny": Shape(None, 2, 64, 4, 2, 16, 256, 1000),
}


def modelled(
    hardware: str, catalog_name: str | None, batch: int, context: int, precision: str = "bf16"
) -> tuple[float, float] | None:
    """(kernel-only, serving) modelled decode-step seconds for the same shape on ``hardware``, or None."""
    if catalog_name is None:
        return None
    dev, mdl = catalog.device(hardware), catalog.model(catalog_name)
    out = []
    for stack in (catalog.stack("none"), catalog.stack()):
        system = hm.make_system(dev, mdl, precision, tp=1, context=context, stack=stack)
        out.append(float(hm.decode_step_s(system, batch, context)))
    return out[0], out[1]


def modelled_ttft(
    hardware: str, catalog_name: str | None, prompt: int, precision: str = "bf16"
) -> float | None:
    """Modelled prefill seconds of one ``prompt``-token request: a bare loop (no server request cost)
    whose prefill launches eagerly (the default stack's per-layer launch cost)."""
    if catalog_name is None:
        return None
    dev, mdl = catalog.device(hardware), catalog.model(catalog_name)
    eager = catalog.stack("none").model_copy(
        update={"prefill_layer_overhead_us": catalog.stack().prefill_layer_overhead_us}
    )
    system = hm.make_system(dev, mdl, precision, tp=1, context=prompt, stack=eager)
    return float(hm.mixed_step_s(system, 0, 0, prefill_tokens=prompt))


# ---------------------------------------------------------------- torch side (imported lazily)


def _linear_factory(torch: Any, fmt: str, device: str) -> Any:
    """Return make(k, n) -> callable(x) computing x @ W for a random (k, n) weight in format ``fmt``."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32

    def rand(k: int, n: int) -> Any:
        return torch.empty(k, n, device=device, dtype=dtype).normal_(0.0, 0.02)

    if fmt == "bf16":

        def make(k: int, n: int) -> Any:
            w = rand(k, n)
            return lambda x: x @ w

        return make
    if fmt == "fp8":
        if not hasattr(torch, "_scaled_mm") or not device.startswith("cuda"):
            raise RuntimeError("fp8 needs CUDA and torch._scaled_mm")

        def make(k: int, n: int) -> Any:
            w = rand(k, n).to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
            one = torch.ones((), device=device, dtype=torch.float32)

            def mm(x: Any) -> Any:
                rows = x.shape[0]
                pad = (-rows) % 16
                xq = torch.nn.functional.pad(x, (0, 0, 0, pad)).to(torch.float8_e4m3fn)
                return torch._scaled_mm(xq, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)[:rows]

            return mm

        return make
    if fmt == "int4":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm") or not device.startswith("cuda"):
            raise RuntimeError("int4 needs CUDA and aten._weight_int4pack_mm")

        def make(k: int, n: int) -> Any:
            q = torch.randint(0, 16, (n, k), device=device, dtype=torch.int32)
            try:  # torch >= 2.5 packs uint8 pairs
                packed = torch.ops.aten._convert_weight_to_int4pack(
                    (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8
                )
            except RuntimeError:
                packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
            sz = torch.ones(k // INT4_GROUP, n, 2, device=device, dtype=torch.bfloat16)
            return lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, INT4_GROUP, sz)

        return make
    raise ValueError(f"unknown weight format {fmt!r}; use {', '.join(FORMATS)}")


class Decoder:
    """A Llama-shaped decoder (GQA attention, SwiGLU MLP, RMSNorm) with a static KV cache."""

    def __init__(self, torch: Any, s: Shape, batch: int, context: int, device: str, fmt: str) -> None:
        self.torch, self.s = torch, s
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        make = _linear_factory(torch, fmt, device)

        def w(*shape: int) -> Any:
            return torch.empty(*shape, device=device, dtype=dtype).normal_(0.0, 0.02)

        self.embed = w(s.vocab, s.hidden)
        self.lm_head = make(s.hidden, s.vocab)
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [
            {
                "wqkv": make(s.hidden, qkv),
                "wo": make(s.heads * s.head_dim, s.hidden),
                "wgu": make(s.hidden, 2 * s.intermediate),
                "wd": make(s.intermediate, s.hidden),
                "n1": torch.ones(s.hidden, device=device, dtype=dtype),
                "n2": torch.ones(s.hidden, device=device, dtype=dtype),
                "k": w(batch, s.kv_heads, context, s.head_dim),
                "v": w(batch, s.kv_heads, context, s.head_dim),
            }
            for _ in range(s.layers)
        ]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.full((1,), context - 1, dtype=torch.long, device=device)

    def _rms(self, x: Any, g: Any) -> Any:
        return x * self.torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * g

    def step(self) -> Any:
        """One decode step: one new token per sequence against the cache."""
        F = self.torch.nn.functional
        s, b = self.s, self.ids.shape[0]
        h = self.embed[self.ids]
        for layer in self.layers:
            qkv = layer["wqkv"](self._rms(h, layer["n1"]))
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            layer["k"].index_copy_(2, self.pos, k.view(b, s.kv_heads, 1, s.head_dim))
            layer["v"].index_copy_(2, self.pos, v.view(b, s.kv_heads, 1, s.head_dim))
            att = F.scaled_dot_product_attention(
                q.view(b, s.heads, 1, s.head_dim), layer["k"], layer["v"], enable_gqa=True
            )
            h = h + layer["wo"](att.reshape(b, -1))
            gate, up = layer["wgu"](self._rms(h, layer["n2"])).chunk(2, -1)
            h = h + layer["wd"](F.silu(gate) * up)
        return self.lm_head(self._rms(h, self.norm)).argmax(-1)

    def prefill(self, tokens: int) -> Any:
        """One eager forward pass over a ``tokens``-token prompt of sequence 0 (causal attention)."""
        F = self.torch.nn.functional
        s = self.s
        h = self.embed[self.torch.zeros(tokens, dtype=self.torch.long, device=self.ids.device)]
        for layer in self.layers:
            qkv = layer["wqkv"](self._rms(h, layer["n1"]))
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            k = k.view(tokens, s.kv_heads, s.head_dim).transpose(0, 1)
            v = v.view(tokens, s.kv_heads, s.head_dim).transpose(0, 1)
            layer["k"][0, :, :tokens].copy_(k)
            layer["v"][0, :, :tokens].copy_(v)
            att = F.scaled_dot_product_attention(
                q.view(tokens, s.heads, s.head_dim).transpose(0, 1)[None], k[None], v[None],
                is_causal=True, enable_gqa=True,
            )  # fmt: skip
            h = h + layer["wo"](att[0].transpose(0, 1).reshape(tokens, -1))
            gate, up = layer["wgu"](self._rms(h, layer["n2"])).chunk(2, -1)
            h = h + layer["wd"](F.silu(gate) * up)
        return self.lm_head(self._rms(h[-1:], self.norm)).argmax(-1)


def _time(torch: Any, fn: Any, steps: int, device: str, graphs: bool) -> float:
    """Mean seconds per call after warm-up (CUDA events; optionally replaying a CUDA graph)."""
    if device.startswith("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = fn
        if graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / steps
    fn()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every measurement the run will make, with the model's numbers (no torch needed)."""
    rows: list[dict[str, Any]] = []
    for name in args.shape.split(","):
        shape = SHAPES[name.strip()]
        for fmt in args.weights.split(","):
            for batch in (int(x) for x in args.batches.split(",")):
                row: dict[str, Any] = {"what": "decode", "shape": name, "weights": fmt, "batch": batch}
                pred = modelled(args.hardware, shape.catalog_name, batch, args.context, fmt)
                if pred is not None:
                    row.update(model_kernel_ms=pred[0] * 1e3, model_serving_ms=pred[1] * 1e3)
                rows.append(row)
            for prompt in (int(x) for x in args.ttft_prompts.split(",") if x.strip()):
                row = {"what": "ttft", "shape": name, "weights": fmt, "batch": 1, "prompt": prompt}
                pred_t = modelled_ttft(args.hardware, shape.catalog_name, prompt, fmt)
                if pred_t is not None:
                    row.update(model_kernel_ms=pred_t * 1e3)
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b,8b", help="comma list of: " + ", ".join(SHAPES))
    ap.add_argument("--weights", default="bf16,fp8,int4", help="comma list of: " + ", ".join(FORMATS))
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--ttft-prompts", default="16,128", help="prompt lengths for the eager prefill (TTFT)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--hardware", default="h200-sxm", help="catalog device to compare with")
    ap.add_argument(
        "--no-graphs", action="store_true", help="time eager decode steps (launch overhead included)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the model's numbers; no torch")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the short GPU check: 1b,8b x bf16,fp8,int4 at batch 1 and 8, TTFT 16/128, 20 steps, 270 s budget",
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="start no new row after this many seconds (0: no limit)"
    )
    ap.add_argument("--out", default="bench/results/gpu_decode.json", help="JSON results file ('' = none)")
    args = ap.parse_args(argv)
    if args.quick:  # the short check overrides the sweep's defaults (explicit flags still win)
        given = sys.argv[1:] if argv is None else argv
        for flag, value in (("--batches", "1,8"), ("--steps", 20), ("--ttft-prompts", "16,128")):
            if not any(a == flag or a.startswith(flag + "=") for a in given):
                setattr(args, flag.lstrip("-").replace("-", "_"), value)
        if args.budget_s is None:
            args.budget_s = QUICK_BUDGET_S
    for fmt in args.weights.split(","):
        if fmt not in FORMATS:
            ap.error(f"--weights: unknown format {fmt!r}; use {', '.join(FORMATS)}")
    rows = plan(args)
    started = time.monotonic()
    meta: dict[str, Any] = {"quick": args.quick, "budget_s": args.budget_s}
    header = f"{'what':>6} {'shape':>5} {'weights':>7} {'batch':>5} {'prompt':>6} {'measured ms':>12} {'model kernel ms':>16} {'model serving ms':>17}"
    print(header)
    if not args.dry_run:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        meta.update(device=device, torch=torch.__version__)
        if device.startswith("cuda"):
            meta["device_name"] = torch.cuda.get_device_name()
            print(f"# {meta['device_name']}  torch {torch.__version__}")
        for row in rows:
            shape = SHAPES[row["shape"]]
            if args.budget_s and time.monotonic() - started > args.budget_s:
                row["unsupported"] = f"skipped: past the {args.budget_s:.0f} s budget"
                _print_row(row)
                continue
            try:
                if row["what"] == "decode":
                    dec = Decoder(torch, shape, row["batch"], args.context, device, row["weights"])
                    row["measured_ms"] = 1e3 * _time(torch, dec.step, args.steps, device, not args.no_graphs)
                else:
                    dec = Decoder(torch, shape, 1, max(args.context, row["prompt"]), device, row["weights"])
                    row["measured_ms"] = 1e3 * _time(
                        torch,
                        lambda d=dec, n=row["prompt"]: d.prefill(n),
                        max(3, args.steps // 5),
                        device,
                        False,
                    )
                del dec
            except (RuntimeError, NotImplementedError, TypeError) as exc:  # format unsupported here
                row["unsupported"] = str(exc).splitlines()[0][:120]
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            _print_row(row)
    else:
        for row in rows:
            _print_row(row)
    if args.out and not args.dry_run:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "hardware": args.hardware,
                    "context": args.context,
                    "steps": args.steps,
                    "wall_s": round(time.monotonic() - started, 1),
                    **meta,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return rows


def _print_row(row: dict[str, Any]) -> None:
    def f(key: str) -> str:
        v = row.get(key)
        return "-" if v is None else f"{v:.3f}"

    measured = (
        row.get("unsupported", f("measured_ms")) if "measured_ms" in row or "unsupported" in row else "plan"
    )
    print(
        f"{row['what']:>6} {row['shape']:>5} {row['weights']:>7} {row['batch']:>5} {row.get('prompt', '-')!s:>6} "
        f"{measured:>12} {f('model_kernel_ms'):>16} {f('model_serving_ms'):>17}",
        flush=True,
    )


if __name__ == "__main__":
    main()
