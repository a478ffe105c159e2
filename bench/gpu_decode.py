"""Measure decode step time of random-weight Llama-shaped decoders and print it beside the model.

Weights' values don't change speed, so random bf16 weights of the published shapes stand in for the real
checkpoints. Each batch size decodes against a KV cache of ``--context`` tokens; on CUDA the step is
captured in a CUDA graph (as serving engines do) so the timing is the GPU's, not Python's.

    python bench/gpu_decode.py                       # H200: 1B and 8B shapes, batch 1..64
    python bench/gpu_decode.py --shape tiny --device cpu --batches 1,2 --steps 3   # smoke test

The "model" columns come from ``voicepipe.hardware.model`` for ``--hardware`` (same numbers as
``voicepipe hardware predict --hardware h200-sxm --model llama-3.1-8b --batch B``): "kernel" drops the
serving stack's per-step scheduler overhead (this loop has none), "serving" keeps it. Rotary embeddings
and sampling are omitted (a few percent of a step).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from voicepipe.hardware import catalog
from voicepipe.hardware import model as hm


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


class Decoder:
    """A Llama-shaped decoder (GQA attention, SwiGLU MLP, RMSNorm) with a static KV cache."""

    def __init__(self, s: Shape, batch: int, context: int, device: str, dtype: torch.dtype) -> None:
        def w(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=dtype).normal_(0.0, 0.02)

        self.s = s
        self.embed = w(s.vocab, s.hidden)
        self.lm_head = w(s.hidden, s.vocab)
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [
            {
                "wqkv": w(s.hidden, qkv),
                "wo": w(s.heads * s.head_dim, s.hidden),
                "wgu": w(s.hidden, 2 * s.intermediate),
                "wd": w(s.intermediate, s.hidden),
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

    @staticmethod
    def _rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * g

    def step(self) -> torch.Tensor:
        s, b = self.s, self.ids.shape[0]
        h = self.embed[self.ids]
        for layer in self.layers:
            qkv = self._rms(h, layer["n1"]) @ layer["wqkv"]
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            layer["k"].index_copy_(2, self.pos, k.view(b, s.kv_heads, 1, s.head_dim))
            layer["v"].index_copy_(2, self.pos, v.view(b, s.kv_heads, 1, s.head_dim))
            att = F.scaled_dot_product_attention(
                q.view(b, s.heads, 1, s.head_dim), layer["k"], layer["v"], enable_gqa=True
            )
            h = h + att.reshape(b, -1) @ layer["wo"]
            gate, up = (self._rms(h, layer["n2"]) @ layer["wgu"]).chunk(2, -1)
            h = h + (F.silu(gate) * up) @ layer["wd"]
        return (self._rms(h, self.norm) @ self.lm_head).argmax(-1)


def time_step(dec: Decoder, steps: int, device: str, graphs: bool) -> float:
    """Median-free mean seconds per decode step after warm-up."""
    if device.startswith("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                dec.step()
        torch.cuda.current_stream().wait_stream(stream)
        run = dec.step
        if graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dec.step()
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
    dec.step()
    t = time.perf_counter()
    for _ in range(steps):
        dec.step()
    return (time.perf_counter() - t) / steps


def modelled(hardware: str, catalog_name: str | None, batch: int, context: int) -> tuple[float, float] | None:
    """(kernel-only, serving) modelled step seconds for the same shape on ``hardware``, or None."""
    if catalog_name is None:
        return None
    dev, mdl = catalog.device(hardware), catalog.model(catalog_name)
    out = []
    for eff in (hm.KERNEL_ONLY, hm.DEFAULT_EFFICIENCY):
        system = hm.make_system(dev, mdl, "bf16", tp=1, seqs=batch, context=context, eff=eff)
        out.append(float(hm.decode_step_s(system, batch, context)))
    return out[0], out[1]


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b,8b", help="comma list of: " + ", ".join(SHAPES))
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hardware", default="h200-sxm", help="catalog device to compare with")
    ap.add_argument("--no-graphs", action="store_true", help="time eager steps (launch overhead included)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write results to this file")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.device.startswith("cuda"):
        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows: list[dict[str, object]] = []
    print(
        f"{'shape':>5} {'batch':>5} {'measured ms':>12} {'model kernel ms':>16} {'model serving ms':>17} {'meas/kernel':>12}"
    )
    for name in args.shape.split(","):
        shape = SHAPES[name.strip()]
        for batch in (int(x) for x in args.batches.split(",")):
            dec = Decoder(shape, batch, args.context, args.device, dtype)
            measured = time_step(dec, args.steps, args.device, graphs=not args.no_graphs)
            del dec
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            pred = modelled(args.hardware, shape.catalog_name, batch, args.context)
            row: dict[str, object] = {"shape": name, "batch": batch, "measured_ms": measured * 1e3}
            if pred is not None:
                row.update(model_kernel_ms=pred[0] * 1e3, model_serving_ms=pred[1] * 1e3)
            rows.append(row)
            k = (
                f"{pred[0] * 1e3:16.3f} {pred[1] * 1e3:17.3f} {measured / pred[0]:12.2f}"
                if pred
                else f"{'-':>16} {'-':>17} {'-':>12}"
            )
            print(f"{name:>5} {batch:>5} {measured * 1e3:12.3f} {k}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(
                {"device": args.device, "hardware": args.hardware, "context": args.context, "rows": rows},
                fh,
                indent=2,
            )
    return rows


if __name__ == "__main__":
    main()
