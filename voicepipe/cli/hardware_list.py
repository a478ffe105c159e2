"""``voicepipe hardware list``: the catalog's devices, models, serving stacks and empirical profiles as tables
(datasheet and published figures; ``hardware show NAME`` prints each one's sources)."""

from __future__ import annotations

from rich.console import Console

from voicepipe.backends.empirical import profiles
from voicepipe.hardware import catalog
from voicepipe.report.term import Col, print_fitted


def print_catalog(con: Console, wide: bool) -> None:
    """Every catalog table, fitted to the console's width (``wide``: no column dropped)."""
    name, desc = Col("device", justify="left"), Col("description", 3, "left", text=True, min_width=16)
    rows = []
    for key, d in catalog.devices().items():
        mem = f"{d.memory_gb:g} GB" if d.kind == "hbm" else f"{d.sram_gb:g} GB SRAM"
        bw = f"{d.mem_bw_tbs:g}" if d.kind == "hbm" else f"{d.sram_bw_tbs:g}"
        rows.append([key, mem, bw, f"{d.peak_tflops['bf16']:g}", f"{d.price_per_chip_hour:g}", d.name])
    cols = [name, Col("memory"), Col("TB/s"), Col("bf16 TF", 1), Col("$/chip-h", 2), desc]
    title = "Devices (datasheet figures; `hardware show NAME` for sources)"
    print_fitted(con, cols, rows, wide=wide, title=title)
    rows = []
    for key, m in catalog.models().items():
        q = f"{m.quality.score:g}" if m.quality else "-"
        active = f"{m.params_active_b:g}" if m.params_active_b else "="
        rows.append([key, f"{m.params_total_b:g}", active, str(m.layers), f"{m.heads}/{m.kv_heads}",
                     m.default_precision, q])  # fmt: skip
    cols = [Col("model", justify="left"), Col("params B"), Col("active B"), Col("layers", 2), Col("heads/kv", 2),
            Col("precision", 1, "left"), Col("quality", 1)]  # fmt: skip
    print_fitted(con, cols, rows, wide=wide, title="Models (published configs)")
    rows = [
        [k, f"{st.step_overhead_us:g}", f"{st.seq_overhead_us:g}", f"{st.request_overhead_ms:g}",
         f"{st.client_overhead_ms:g}", st.timing, st.name]
        for k, st in catalog.stacks().items()
    ]  # fmt: skip
    cols = [Col("stack", justify="left"), Col("step µs"), Col("seq µs", 2), Col("request ms"),
            Col("client ms", 2), Col("TTFT", 2, "left"), desc]  # fmt: skip
    print_fitted(con, cols, rows, wide=wide, title=f"Serving stacks (default {catalog.default_stack_name()})")
    rows = []
    for key, p in profiles().items():
        rows.append([key, f"{p['ttft_ms']['median']:g}", f"{p['tokens_per_s']:g}",
                     f"{p['price_in_per_mtok']:g}/{p['price_out_per_mtok']:g}", p.get("description", "")])  # fmt: skip
    cols = [Col("profile", justify="left"), Col("TTFT ms"), Col("tok/s"), Col("$/Mtok in/out", 1), desc]
    print_fitted(con, cols, rows, wide=wide, title="Empirical profiles (measured services)")
    con.print("Use DEVICE/MODEL (e.g. cerebras-wse3/llama-3.1-8b) as an agent backend.")
