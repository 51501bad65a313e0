"""Render docs/performance.md from benchmarks/results/*.json.

    python3 benchmarks/render_performance.py            # writes docs/performance.md
    python3 benchmarks/render_performance.py --check    # exits 1 where docs/performance.md differs from its render

The prose is written here and every figure in it and in the tables is read from a result file (see harness.py for
their layout), so the page cannot drift from the data: a result file that changes, or a run that a section reads and
that is gone, changes the render or stops it, and tests/test_performance_page.py fails until the page is rendered
again. The page says what holds now; dates, commits and machines are in its provenance table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
DATASHEET_TFLOPS = 989  # dense bf16, H100 SXM and H200 SXM alike (NVIDIA lists 1,979 with 2:4 sparsity)


class Results:
    """The result files, and the provenance row numbers that tables cite as [n]."""

    def __init__(self, folder: Path):
        self.files = {path.name.removesuffix(".json"): json.loads(path.read_text())["runs"]
                      for path in sorted(folder.glob("*.json"))}
        self.numbers = {name: number for number, name in enumerate(self.files, 1)}

    def run(self, name: str, command_has: str = "", command_lacks: str | None = None) -> dict:
        """The one run of file `name` whose command contains `command_has` (and not `command_lacks`)."""
        [found] = [run for run in self.files[name]
                   if command_has in run["command"] and not (command_lacks and command_lacks in run["command"])]
        return found

    def cite(self, name: str, run: dict) -> str:
        """[n] for result file n of the provenance table, [n.k] for its run k where it holds several."""
        runs = self.files[name]
        return f"[{self.numbers[name]}]" if len(runs) == 1 else f"[{self.numbers[name]}.{runs.index(run) + 1}]"


def result(run: dict, model: str) -> dict:
    """The one result of `run` whose model name contains `model`."""
    [found] = [r for r in run["results"] if model in r["model"]]
    return found


def ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 10_000 else f"{value:.1f}"


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def gpu(run: dict) -> str:
    name = run["machine"].removeprefix("NVIDIA ")
    return "H100 80GB" if name.startswith("H100") else name


def tflops(r: dict) -> float:
    return r.get("tflops", r.get("tflops_lower_bound"))


def mfu(r: dict) -> float:
    return r.get("mfu", r.get("mfu_lower_bound"))


def out_of_memory(r: dict) -> str:
    if "gpu_memory_gib" in r:
        return f"out of memory ({r['gpu_memory_gib']:.1f} GiB GPU)"
    return f"out of memory ({r['peak_memory_gib']:.1f} GiB reserved at the peak)"


def reflow(text: str, width: int = 118) -> str:
    """Prose paragraphs and list items re-wrapped to `width` (figures substituted into the prose leave short lines);
    tables, indented code and headings kept as they are."""
    out, item, indent, code = [], [], ("", ""), False

    def flush():
        if item:
            out.append(textwrap.fill(" ".join(item), width, initial_indent=indent[0], subsequent_indent=indent[1],
                                     break_long_words=False, break_on_hyphens=False))
            item.clear()

    for line in text.split("\n"):
        stripped = line.lstrip()
        marker = re.match(r"(- |\d+\. )", stripped)
        code = bool(stripped) and line.startswith("    ") and (code or not item and (not out or not out[-1]))
        if not stripped or code or line.startswith(("|", "#")):
            flush()
            out.append(line)
        elif marker or not item:
            flush()
            lead = line[:len(line) - len(stripped)]
            indent = (lead, lead + " " * len(marker.group(1))) if marker else (lead, lead)
            item.append(stripped)
        else:
            item.append(stripped)
    flush()
    return "\n".join(out)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def method(res: Results) -> str:
    peaks = [run["peak_tflops"] for runs in res.files.values() for run in runs if "peak_tflops" in run]
    low, high = min(peaks), max(peaks)
    return f"""## Method
- **Same-run baselines.** Each benchmark times its baseline in the same run as our code, and ratios are only taken
  within one run: a baseline run on another day, machine or warm-up state moves by more than the differences measured.
- **Timing.** GPU: mean wall time of `--steps` timed steps (`harness.time_steps`), with `torch.cuda.synchronize()`
  before and after the timed loop, after `--warmup` untimed steps; DeepSeek-V4 also reports its first step, which
  compiles the fused kernels and captures the CUDA graphs. CPU: see the conversion section.
- **MFU, two ways.** Model FLOPs per step over the step time, divided by
  1. the bf16 matmul rate **measured in the same run** (`harness.matmul_peak_tflops`: ten 8192 x 8192 x 8192 bf16
     GEMMs after three untimed ones): what this GPU, clock and driver reach on the best case of a training step's
     work; and
  2. the **datasheet peak**, {DATASHEET_TFLOPS} TFLOP/s of dense bf16 for the H100 SXM and the H200 SXM alike. The
     measured rate in the runs below is {low:.0f}-{high:.0f} TFLOP/s, {low / DATASHEET_TFLOPS:.0%}-{high / DATASHEET_TFLOPS:.0%}
     of it, so MFU against the datasheet is about {(low + high) / 2 / DATASHEET_TFLOPS:.1f} x MFU against the measured rate.
- **FLOPs.** 6 x the matmul parameters each token passes through (forward + backward), plus attention over the entries
  actually attended (causal: s(s+1)/2 query-key pairs per head; a window W: about s x W), x 3 for forward + backward;
  recomputed work is not counted. LoopCoder counts both loops. DeepSeek-V4 counts the attention projections, the
  active and shared experts and the head, and attention over the window and the visible compressed entries; its
  compressor, indexer and hyper-connection matmuls are left out, so its figures are lower bounds ("(>=)").
- **Peak memory.** `torch.cuda.max_memory_reserved()`: what the caching allocator holds at its peak (CUDA graph pools
  included), the figure that decides whether a step fits. The dense benchmark's batch-2 table and the DeepSeek-V4
  table at 4096-8192 tokens hold `torch.cuda.max_memory_allocated()` (the live tensors at the peak; reserved is at
  least this) and say so.
- **Setup.** bf16 models, one GPU, TP 1; the software versions of each run are in the provenance table."""


def dense(res: Results) -> str:
    name = "dense_h200"
    run = res.run(name)
    rows, by = [], {r["model"]: r for r in run["results"]}
    labels = {"hf-llama-sdpa": "transformers Llama, SDPA (baseline)", "hf-loopcoder": "our HF LoopCoder reference (SDPA)",
              "megatron-llama-fast": "**Megatron Llama, `attention=\"fast\"`**",
              "megatron-loopcoder": "**Megatron LoopCoder, `attention=\"fast\"`**"}
    for model, label in labels.items():
        r = by[model]
        rows.append([label, ms(r["ms_per_step"]), f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.0f}", pct(r["mfu"]),
                     pct(r["tflops"] / DATASHEET_TFLOPS), f"{r['peak_memory_gib']:.1f}",
                     f"{r['tokens_per_s_vs_hf_llama']:.2f}", f"{r['memory_vs_hf_llama']:.2f}"])
    loop, llama = by["megatron-loopcoder"], by["megatron-llama-fast"]
    header = ["model", "ms/step", "tokens/s", "TFLOP/s", "MFU (measured rate)", "MFU (datasheet)",
              "peak allocated GiB", "tokens/s vs HF Llama", "memory vs HF Llama"]
    return f"""## Dense training step: Llama baseline and LoopCoder
`python3 benchmarks/bench_dense.py` {res.cite(name, run)}, one {gpu(run)}, bf16 matmul rate measured in the run:
{run['peak_tflops']:.0f} TFLOP/s.

{table(header, rows)}

Setup: bf16, forward + backward of the mean token loss, batch {run['batch']} x {run['seq']}, hidden 2048, 16 layers,
16 query / 4 KV heads of 128, intermediate 5632, vocab 32000; LoopCoder with `loop_num` 2 and `loop_window_size` 64.
`attention="fast"` is SDPA for causal attention and flex_attention with a block mask for LoopCoder's window.

LoopCoder runs every layer twice, and loop 2 attends twice (globally over loop 1's K/V, locally over its own): against
our Megatron Llama it runs at {loop['tokens_per_s'] / llama['tokens_per_s']:.2f} x the tokens/s for
{loop['tflops'] / llama['tflops']:.2f} x the TFLOP/s. Its memory is {loop['memory_vs_hf_llama']:.2f} x the baseline's: the
loop-1 K/V of every layer are held for loop 2's global attention (once, as the autograd graph's saved tensors), and
both loops' activations are saved for the backward.

What limits it, and what would move it:
- Both Megatron models use Megatron-Core's local spec around the fast attention: RMSNorm, SwiGLU and RoPE run as
  eager PyTorch ops (one pass over the activations each). Fused kernels for them (Transformer Engine's spec, or
  `@fused` as DeepSeek-V4 uses) would cut that memory traffic.
- The logits are computed in full; the token log-probabilities take one pass each way over them
  (`modelzoo/logprobs.py`), in their own dtype.
- LoopCoder's memory: activation recompute trades it for time (docs/loopcoder.md; long rows below)."""


def deepseek_v4(res: Results) -> str:
    rows, ours_by_seq, theirs_memory = [], {}, {}
    for config, seq in (("large", 4096), ("large", 6144), ("large", 8192), ("small", 4096), ("small", 8192)):
        name = f"deepseek_v4_{config}_seq{seq}_h200"
        run = res.run(name)
        theirs, ours = result(run, "transformers"), result(run, "fast+graphs")
        if config == "large":
            ours_by_seq[seq] = ours
            theirs_memory[seq] = theirs
        oom = theirs.get("out_of_memory")
        rows.append([f"{config}", f"{seq}", out_of_memory(theirs) if oom else ms(theirs["ms_per_step"]),
                     f"**{ms(ours['ms_per_step'])}**", "n/a" if oom else f"**{ours['tokens_per_s_vs_hf']:.2f}**",
                     f"{ours['tflops_lower_bound']:.0f}",
                     f"{pct(ours['mfu_lower_bound'])} / {pct(ours['tflops_lower_bound'] / DATASHEET_TFLOPS)} "
                     f"({run['peak_tflops']:.0f})",
                     f"{'-' if oom else format(theirs['peak_memory_gib'], '.1f')} / {ours['peak_memory_gib']:.1f}",
                     f"{'-' if oom else format(theirs['loss'], '.4f')} / {ours['loss']:.4f}", res.cite(name, run)])
    firsts = [result(res.run(f"deepseek_v4_{c}_seq{s}_h200"), "fast+graphs")["first_step_s"]
              for c, s in (("large", 4096), ("large", 6144), ("large", 8192), ("small", 4096), ("small", 8192))]
    theirs_firsts = [r["first_step_s"] for r in theirs_memory.values() if "first_step_s" in r]
    header = ["`--config`", "`--seq`", "transformers eager, ms/step", "ours `fast+graphs`, ms/step",
              "tokens/s vs transformers", "ours, TFLOP/s (>=)", "MFU (>=), measured rate / datasheet",
              "peak allocated GiB, theirs / ours", "first-step loss, theirs / ours", "source"]
    s4, s6, s8 = (ours_by_seq[s] for s in (4096, 6144, 8192))
    return f"""## DeepSeek-V4 training step
`python3 benchmarks/bench_deepseek_v4.py --paths fast+graphs --steps 3 --config <config> --seq <seq>`, one H200; the
number in brackets is the bf16 matmul rate measured in that run (TFLOP/s).

{table(header, rows)}

Our first step, compilation and graph capture included, takes {min(firsts):.0f}-{max(firsts):.0f} s; transformers'
{min(theirs_firsts):.1f}-{max(theirs_firsts):.1f} s.

Configs (`benchmarks/bench_deepseek_v4.py`), both at the release attention ratios (window 128, compress ratios 4 /
128, index top-k 512, YaRN factor 16 over 4096 positions), bf16, batch 1 x `--seq`, forward + backward of the mean
token loss, the same random weights and tokens in both models (so the losses agree to bf16 rounding):
- `large`, about 1B active: hidden 2048, 12 layers (4 each of sliding, CSA, HCA), 16 heads x 512, 16 experts top-6
  + 1 shared of 1024, hc_mult 4.
- `small`: hidden 1024, 6 layers (2 of each), 16 heads x 256, 16 experts top-4 + 1 shared, hc_mult 4.

Ours is `attention="fast"` with `model.capture_cuda_graphs(ids)`: the decoder layer stack's forward and backward each
replayed as one CUDA graph (docs/deepseek_v4.md, "CUDA graphs"). transformers' `DeepseekV4ForCausalLM` is eager (its
only implementation).

Length: our step time grows linearly with the sequence ({ms(s4['ms_per_step'])} -> {ms(s6['ms_per_step'])} ->
{ms(s8['ms_per_step'])} ms for 4096 -> 6144 -> 8192 tokens) and so does its memory ({s4['peak_memory_gib']:.1f} ->
{s6['peak_memory_gib']:.1f} -> {s8['peak_memory_gib']:.1f} GiB): per query, the attention reads a bounded set of
entries (the window, the index top-k, the compressed entries). transformers' eager attention materialises
`[heads, S, S + C]` scores, so its memory grows with the square of the length
({theirs_memory[4096]['peak_memory_gib']:.1f} -> {theirs_memory[6144]['peak_memory_gib']:.1f} GiB on `large`), and at
8192 tokens it does not fit the H200's {theirs_memory[8192]['gpu_memory_gib']:.1f} GiB.

What limits it: the MoE's grouped GEMMs and the projections (the largest items; `small`'s half-width matrices run at
lower MFU); thousands of small kernels (norms, RoPE, the hyper-connections, the router), each a pass over its tensors
(CUDA graphs remove their launches, not their passes); the hyper-connections' Triton kernels, bound by memory
bandwidth; the sliding and HCA layers' fp32 score blocks, written and read back (`model/window_attention.py`). Not
measured on GPUs: EP > 1 (CUDA graphs refused there). `--profile --profile-steps 3` prints the step's kernels."""


def deepseek_v41(res: Results) -> str:
    short, long = "deepseek_v41_large_seq4096_h100", "deepseek_v41_large_seq16384_full_recompute_h100"
    rows, memory = [], {}
    for name, recompute in ((short, "none"), (long, "full")):
        run = res.run(name)
        reference = next((r for r in run["results"] if r["model"].startswith("reference")), None)
        ours = memory[name] = result(run, "fast")
        rows.append([f"{run['seq']}", recompute, "not run" if reference is None else out_of_memory(reference)
                     if reference.get("out_of_memory") else ms(reference["ms_per_step"]), ms(ours["ms_per_step"]),
                     f"{ours['tokens_per_s']:,.0f}", f"{ours['tflops_lower_bound']:.0f}",
                     f"{pct(ours['mfu_lower_bound'])} ({run['peak_tflops']:.0f})", f"{ours['peak_memory_gib']:.1f}",
                     res.cite(name, run)])
    header = ["`--seq`", "recompute", "our reference (eager), ms/step", "ours `fast`, ms/step", "tokens/s",
              "TFLOP/s (>=)", "MFU (>=), measured rate", "peak reserved GiB", "source"]
    return f"""## DeepSeek-V4.1 training step
`python3 benchmarks/bench_deepseek_v41.py --config large --seq <S> --paths fast [--no-hf --recompute full]`, one H100;
`large` is 1.16B active, the release's 40 layers of ratios and roles scaled to 12 (the script's docstring).

{table(header, rows)}

Our reference's eager attention (`[heads, S, S + T]` scores) does not fit at 4096 tokens: the ratio is not measured.
These runs predate the picks as ids ({memory[short]['peak_memory_gib']:.0f} GiB at 4096 tokens held [S, T] masks);
the ids path (docs/deepseek_v41.md) is linear in memory by test, not yet measured on a GPU."""


def deepseek_v4_long(res: Results) -> str:
    full_h100 = "deepseek_v4_large_seq65536_full_recompute_h100"
    sparse_run = res.run(full_h100, "fast+dense-csa")
    indexer_recomputed = res.run(full_h100, "calling self.indexer directly")
    indexer_kept = res.run(full_h100, "--paths fast --no-hf", command_lacks="calling self.indexer directly")
    keep_run = res.run(full_h100, "fast,fast+keep-attention")
    block11 = res.run("deepseek_v4_large_seq65536_full_block11_recompute_h100")
    block6_h200 = res.run("deepseek_v4_large_seq65536_full_block6_recompute_h200")
    full_h200 = res.run("deepseek_v4_large_seq65536_full_recompute_h200")

    rows = []

    def add(name: str, run: dict, r: dict) -> None:
        label = r["model"].removeprefix("megatron deepseek_v4 (").removesuffix(")").replace(", recompute ", ", ")
        seq = r.get("seq", run.get("seq"))
        if r.get("out_of_memory"):
            rows.append([gpu(run), f"{seq}", label, out_of_memory(r), "", "", "", "", res.cite(name, run)])
            return
        rows.append([gpu(run), f"{seq}", label, ms(r["ms_per_step"]), f"{r['tokens_per_s']:,.0f}",
                     f"{r['tflops_lower_bound']:.0f}", f"{pct(r['mfu_lower_bound'])} ({run['peak_tflops']:.0f})"
                     if "peak_tflops" in run else pct(r["mfu_lower_bound"]), f"{r['peak_memory_gib']:.1f}",
                     res.cite(name, run)])

    for name in (full_h100, "deepseek_v4_large_seq65536_full_block11_recompute_h100",
                 "deepseek_v4_large_seq65536_full_block7_recompute_h100",
                 "deepseek_v4_large_seq65536_full_block6_recompute_h100",
                 "deepseek_v4_large_seq65536_full_recompute_h200", "deepseek_v4_large_seq65536_full_block6_recompute_h200"):
        latest = {}  # each path's latest run; the comparisons below cite the others
        for run in sorted(res.files[name], key=lambda run: run["date"]):
            for r in run["results"]:
                if "dense-csa" not in r["model"]:
                    latest[r["model"]] = run, r
        for run, r in latest.values():
            add(name, run, r)
    for run in res.files["longest_fit_deepseek_v4_ours_full_h100"]:
        for probe in run["probes"]:
            add("longest_fit_deepseek_v4_ours_full_h100", run, probe)
    oom_131072 = res.run("deepseek_v4_large_seq131072_full_recompute_h100")
    add("deepseek_v4_large_seq131072_full_recompute_h100", oom_131072, oom_131072["results"][0])
    header = ["GPU", "`--seq`", "path, recompute", "ms/step", "tokens/s", "TFLOP/s (>=)", "MFU (>=), measured rate",
              "peak reserved GiB", "source"]

    sparse, dense_csa = result(sparse_run, "(fast,"), result(sparse_run, "fast+dense-csa")
    kept, recomputed = result(indexer_kept, "(fast,"), result(indexer_recomputed, "(fast,")
    plain, keep = result(keep_run, "(fast,"), result(keep_run, "fast+keep-attention")
    b11 = result(block11, "full_block11")
    b6, every = result(block6_h200, "full_block6"), result(full_h200, "keep-attention")
    step_tflop = b6["tflops_lower_bound"] * b6["ms_per_step"] / 1e3
    ms_for_35 = step_tflop / (0.35 * block6_h200["peak_tflops"]) * 1e3
    return f"""### DeepSeek-V4 `large` at 65536 tokens and longer, with activation recompute
`python3 benchmarks/bench_deepseek_v4.py --config large --seq <S> --paths <paths> --steps <N> --warmup 1 --no-hf
--recompute full [--recompute-layers <L>]` (Megatron's `recompute_granularity` / `recompute_method` /
`recompute_num_layers`, docs/deepseek_v4.md), without CUDA graphs; the longer rows are `bench_longest_fit.py
deepseek_v4 ours --recompute full --start S --max S` probes. `full_block<L>` recomputes the first L of the 12 layers;
`fast+keep-attention` keeps each layer's attention output across the recompute. Each path's latest run is shown; the
comparisons below cite the runs they compare.

{table(header, rows)}

35% MFU at 65536 tokens is **met on an H200**: {pct(b6['mfu_lower_bound'])} ({ms(b6['ms_per_step'])} ms/step,
{b6['peak_memory_gib']:.1f} GiB reserved) with full recompute of the first 6 of the 12 layers and the attention output
kept; every layer recomputed runs at {pct(every['mfu_lower_bound'])} on the same machine (block 6 runs at
{every['ms_per_step'] / b6['ms_per_step']:.2f}x that step rate, for {b6['peak_memory_gib'] - every['peak_memory_gib']:.1f}
GiB more). 35% needs a step of at most about {ms_for_35:.0f} ms at this FLOP count ({step_tflop:.0f} TFLOP per step,
the recomputed forward not counted). On an H100 the best is {pct(keep['mfu_lower_bound'])} (every layer recomputed,
attention output kept): keeping 5 or 6 layers' activations (`block` 7 or 6) needs more than its 80 GB.

What this step is made of:
- **CSA attention over each query's own keys.** On a GPU the CSA layers run Triton kernels
  (`model/sparse_attention_kernels.py`, docs/deepseek_v4.md) over each query's window keys and its 512 picked
  entries, O(S x (window + k)), instead of dense blocks that score every complete compressed entry and mask all but
  the picks (O(S^2 / 4)). In one run {res.cite(full_h100, sparse_run)}: {ms(sparse['ms_per_step'])} against
  {ms(dense_csa['ms_per_step'])} ms/step with the kernels patched out, **{dense_csa['ms_per_step'] / sparse['ms_per_step']:.2f}x**
  the step rate, {sparse['peak_memory_gib']:.1f} against {dense_csa['peak_memory_gib']:.1f} GiB reserved (the kernels' fp32
  kv gradient).
- **The indexer's picks kept across recompute.** `modelzoo.recompute.kept_for_recompute` hands the forward's picks
  to the recompute (held until that layer's backward) instead of re-running the indexer's projections, scores and
  top-k. Two processes one after the other {res.cite(full_h100, indexer_kept)} {res.cite(full_h100, indexer_recomputed)}:
  {ms(kept['ms_per_step'])} against {ms(recomputed['ms_per_step'])} ms/step with the indexer recomputed,
  **{recomputed['ms_per_step'] / kept['ms_per_step']:.2f}x**.
- **The attention's output kept across the recompute.** `keep_attention_output=True` (docs/deepseek_v4.md) keeps each
  layer's attention output and log-sum-exp from the forward (16 KiB per token and layer), so the recompute skips the
  attention kernels. One process {res.cite(full_h100, keep_run)}: {ms(keep['ms_per_step'])} against
  {ms(plain['ms_per_step'])} ms/step, **{plain['ms_per_step'] / keep['ms_per_step']:.2f}x**, for
  {keep['peak_memory_gib'] - plain['peak_memory_gib']:.1f} GiB more at the peak; the same loss
  ({keep['loss']:.4f}) in both.
- **Recompute itself.** Full recompute runs every layer's forward twice. Keeping some layers' activations
  (`--recompute-layers N`, Megatron's `block` method) trades memory for that time: `block` 11 (the last layer kept)
  runs at {ms(b11['ms_per_step'])} ms/step in its own process, {keep['ms_per_step'] / b11['ms_per_step']:.3f}x
  the step rate of every layer recomputed with the attention output kept (one layer's forward is a small part of the step, within what separate processes
  vary); on the H200 `block` 6 takes about {(b6['peak_memory_gib'] - every['peak_memory_gib']) / 6:.0f} GiB per layer
  whose activations are kept. `python3 benchmarks/saved_activations.py --seq 8192 [--recompute <setting>]` lists
  what a layer saves, by module; `--profile --profile-steps 1` prints the step's kernels."""


def loopcoder_long(res: Results) -> str:
    rows = []
    every = result(res.run("dense_b1_seq131072_recompute_full_h200"), "loopcoder")
    labels = {"": "every layer call of both loops (`full`, `uniform`, 1)"}
    for layers in (14, 13, 12):
        labels[f"_block{layers}"] = f"the first {layers} layers of each loop (`full`, `block`, {layers})"
    best = None
    for suffix, label in labels.items():
        name = f"dense_b1_seq131072_recompute_full{suffix}_h200"
        run = res.run(name)
        r = result(run, "loopcoder")
        if r.get("out_of_memory"):
            rows.append([label, out_of_memory(r), "", "", "", "", "", res.cite(name, run)])
            continue
        if best is None or r["mfu"] > best["mfu"]:
            best, best_layers = r, suffix
        rows.append([label, ms(r["ms_per_step"]), f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.0f}", pct(r["mfu"]),
                     f"{every['ms_per_step'] / r['ms_per_step']:.2f}x", f"{r['peak_memory_gib']:.1f}", res.cite(name, run)])
    block14 = result(res.run("dense_b1_seq131072_recompute_full_block14_h200"), "loopcoder")
    per_call = (block14["peak_memory_gib"] - every["peak_memory_gib"]) / 4
    h100_rows = []
    for seq in (65536, 131072):
        name = f"dense_b1_seq{seq}_recompute_full_h100"
        run = res.run(name)
        r = result(run, "loopcoder")
        h100_rows.append([f"{seq}", ms(r["ms_per_step"]), f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.0f}",
                          f"{pct(r['mfu'])} ({run['peak_tflops']:.0f})", f"{r['peak_memory_gib']:.1f}",
                          res.cite(name, run)])
    h100_131072 = result(res.run("dense_b1_seq131072_recompute_full_h100"), "loopcoder")
    h100_65536 = result(res.run("dense_b1_seq65536_recompute_full_h100"), "loopcoder")
    h100_rate = res.run("dense_b1_seq131072_recompute_full_h100")["peak_tflops"]
    attention = res.run("attention_seq131072_h100")
    kernel_labels = {"flash (enable_gqa)": "SDPA flash (`enable_gqa`)", "cudnn (enable_gqa)": "SDPA cuDNN (`enable_gqa`)",
                     "cudnn (kv copied per head)": "SDPA cuDNN (K/V copied per head)",
                     "efficient (enable_gqa)": "SDPA memory-efficient",
                     "flex_attention (causal block mask)": "flex_attention, causal block mask"}
    kernel_rows, cudnn = [], None
    for k in attention["results"]:
        if "error" in k:
            kernel_rows.append([kernel_labels[k["kernel"]], f"refused the call (\"{k['error'].split('.')[0]}\")", "", "", ""])
            continue
        if k["kernel"] == "cudnn (enable_gqa)":
            cudnn = k
        diffs = ", ".join(f"{d:.1e}" for d in k["max_rel_diff_vs_flash_out_dq_dk_dv"])
        kernel_rows.append([kernel_labels[k["kernel"]], ms(k["ms"]), f"{k['tflops']:.0f}", f"{k['speedup_vs_flash']:.2f}x",
                            "-" if k["speedup_vs_flash"] == 1.0 else diffs])
    block = best_layers.removeprefix("_block")
    return f"""## Long rows: LoopCoder at 131072 tokens
The dense benchmark's LoopCoder (hidden 2048, 16 layers, loop_num 2, window 64), batch 1, `attention="fast"`,
`python3 benchmarks/bench_dense.py --batch 1 --seq <S> --recompute full [--recompute-layers N] --only
megatron-loopcoder --steps 1 --warmup 1`. On one H200, at 131072 tokens:

{table(["recompute (Megatron's settings)", "ms/step", "tokens/s", "TFLOP/s", "MFU (measured rate)",
        "step rate vs every layer", "peak reserved GiB", "source"], rows)}

So LoopCoder trains a 131072-token row at {pct(best['mfu'])} MFU on one H200 with `recompute_granularity="full",
recompute_method="block", recompute_num_layers={block}`: the last layers of each loop keep their activations (about
{per_call:.0f} GiB per layer call at this length) and skip the recomputed forward. On an 80 GB H100 even `block` 15
would need about {every['peak_memory_gib']:.0f} + 2 x {per_call:.0f} GiB, more than it has. With every layer call
recomputed, on one H100 80GB:

{table(["`--seq`", "ms/step", "tokens/s", "TFLOP/s", "MFU (measured rate)", "peak reserved GiB", "source"], h100_rows)}

The FLOP count leaves out the recomputed forward (a third more work), so the GPU does about
{h100_131072['mfu'] * 4 / 3:.0%} of its measured rate in matmuls and attention. At 131072 the attention (both loops'
causal attention over the whole row) is most of the counted FLOPs, so the attention kernels' rate is what moves the
figure. The causal attention is SDPA, which on torch 2.11 with an H100 picks cuDNN's fused kernel; flex_attention
runs the window. The kernels alone at this shape (16 query heads, 4 key/value heads, head_dim 128, 1 x 131072,
causal, forward + backward), `python3 benchmarks/bench_attention.py --seq 131072 --steps 3` {res.cite("attention_seq131072_h100", attention)}:

{table(["kernel", "ms", "TFLOP/s", "vs flash", "max \\|diff\\| / max \\|flash\\| (out, dq, dk, dv)"], kernel_rows)}

cuDNN's {cudnn['tflops']:.0f} TFLOP/s is {cudnn['tflops'] / h100_rate:.0%} of the H100's measured matmul rate, so the
attention alone caps the step near the figures above. Memory is linear in the length
({h100_65536['peak_memory_gib']:.1f} -> {h100_131072['peak_memory_gib']:.1f} GiB): the window's flex_attention block
mask is built compiled, never as a [seq, seq] grid."""


def longest_rows(res: Results) -> tuple[str, dict]:
    """The longest-row table: for each model and recompute setting, every probe of it in the result files."""
    settings = [
        ("our LoopCoder", "none", [("dense_b1_seq40960_recompute_none_h200", "megatron-loopcoder")]),
        ("our LoopCoder", "selective (core attention)",
         [("longest_fit_dense_megatron-loopcoder_selective_h200", "megatron-loopcoder")]),
        ("our LoopCoder", "full, block 13", [("dense_b1_seq131072_recompute_full_block13_h200", "megatron-loopcoder")]),
        ("our LoopCoder", "full, every layer", [("longest_fit_dense_megatron-loopcoder_full_h100", "megatron-loopcoder")]),
        ("our HF LoopCoder reference", "transformers' gradient checkpointing",
         [("longest_fit_dense_hf-loopcoder_full_h100", "hf-loopcoder")]),
        ("our DeepSeek-V4 `large`", "selective (`core_attn`, `layernorm`, `moe`)",
         [("deepseek_v4_large_seq65536_selective_recompute_h200", "megatron")]),
        ("our DeepSeek-V4 `large`", "full, block 6, attention output kept",
         [("deepseek_v4_large_seq65536_full_block6_recompute_h200", "megatron")]),
        ("our DeepSeek-V4 `large`", "full, every layer",
         [("longest_fit_deepseek_v4_ours_full_h100", "megatron"),
          ("deepseek_v4_large_seq131072_full_recompute_h100", "megatron")]),
        ("transformers' DeepseekV4 `large` (eager)", "none",
         [("deepseek_v4_large_seq7168_h200", "transformers"), ("deepseek_v4_large_seq8192_h200", "transformers")]),
        ("transformers' DeepseekV4 `large` (eager)", "transformers' gradient checkpointing",
         [("longest_fit_deepseek_v4_transformers_full_h100", "transformers")]),
        ("our Llama", "none", [("longest_fit_dense_megatron-llama-fast_none_h100", "megatron-llama-fast")]),
        ("transformers' Llama (SDPA)", "none", [("longest_fit_dense_hf-llama-sdpa_none_h100", "hf-llama-sdpa")]),
        ("our Llama", "full, every layer", [("longest_fit_dense_megatron-llama-fast_full_h100", "megatron-llama-fast")]),
        ("transformers' Llama (SDPA)", "transformers' gradient checkpointing",
         [("longest_fit_dense_hf-llama-sdpa_full_h100", "hf-llama-sdpa")]),
    ]
    rows, found = [], {}
    for model, setting, sources in settings:
        probes, cites, machines = [], [], set()
        for name, model_has in sources:
            for run in res.files[name]:
                for r in run.get("probes") or run["results"]:
                    if model_has in r["model"]:
                        probes.append((r.get("seq", run.get("seq")), r))
                        machines.add(gpu(run))
                cites.append(res.cite(name, run))
        fitted = [(seq, r) for seq, r in probes if not r.get("out_of_memory")]
        seq, best = max(fitted, key=lambda item: item[0])
        failed = sorted(s for s, r in probes if r.get("out_of_memory") and s > seq)
        step = f"{ms(best['ms_per_step'])} ms, {pct(mfu(best))}"
        rows.append([model, setting, f"**{seq:,}**" if failed else f">= {seq:,}", step,
                     f"{best['peak_memory_gib']:.1f}", f"{failed[0]:,}" if failed else "none recorded",
                     ", ".join(sorted(machines)), " ".join(dict.fromkeys(cites))])
        found[model, setting] = (seq, best, failed[0] if failed else None)
    header = ["model", "recompute", "longest that fit", "its step", "peak reserved GiB", "shortest that did not fit",
              "GPU", "source"]
    return table(header, rows), found


def longest(res: Results) -> str:
    rendered, found = longest_rows(res)
    llama_none, hf_llama_none = found["our Llama", "none"], found["transformers' Llama (SDPA)", "none"]
    llama_full = found["our Llama", "full, every layer"]
    hf_llama_full = found["transformers' Llama (SDPA)", "transformers' gradient checkpointing"]
    loop_full = found["our LoopCoder", "full, every layer"]
    ds_full = found["our DeepSeek-V4 `large`", "full, every layer"]
    hf_ds_full = found["transformers' DeepseekV4 `large` (eager)", "transformers' gradient checkpointing"]
    loop_none, loop_selective = found["our LoopCoder", "none"], found["our LoopCoder", "selective (core attention)"]
    llama_131072 = res.run("longest_fit_dense_megatron-llama-fast_full_h100", "--start 131072")["probes"][0]
    hf_131072 = res.run("longest_fit_dense_hf-llama-sdpa_full_h100", "--start 131072")["probes"][0]
    return f"""### The longest row per recompute setting
`benchmarks/bench_longest_fit.py` finds the longest batch-1 row a model trains at: each probe is one step (after one
untimed step) in a fresh process of `bench_dense.py` or `bench_deepseek_v4.py`; lengths double from `--start` until
one runs out of memory, then bisection steps on multiples of `--granularity`; `--start S --max S` probes one length.
Every probe of a search is a run of its result file. Each row below is read from the probes of its setting in the
files it cites ("longest that fit" is a lower bound where no longer row was probed). The bench configs above, bf16;
the Llama rows are `bench_dense.py`'s Llama (the same size as its LoopCoder without the second loop).

{rendered}

Recomputing the core attention (Megatron's default selective setting) buys LoopCoder nothing: its core attention is
SDPA's fused kernel, which already saves only O(S) per layer, so recomputing it frees no memory
({loop_selective[1]['peak_memory_gib']:.1f} against {loop_none[1]['peak_memory_gib']:.1f} GiB at {loop_none[0]:,} tokens) and
costs time ({ms(loop_selective[1]['ms_per_step'])} against {ms(loop_none[1]['ms_per_step'])} ms, in separate runs on one
machine). What a layer holds is its other activations (norms, MLP), which full recompute frees;
`recompute_modules=["mlp"]` (`--recompute selective-mlp`) frees the MLP's. Our Llama fits
{llama_none[0] / hf_llama_none[0]:.1f}x transformers' row without recompute ({llama_none[0]:,} against
{hf_llama_none[0]:,} tokens on an H100) and, with full recompute, at least {llama_full[0] / hf_llama_full[0]:.0f}x
({llama_full[0]:,} against {hf_llama_full[0]:,}; 131,072 tokens in {llama_131072['peak_memory_gib']:.1f} against
{hf_131072['peak_memory_gib']:.1f} GiB, at {ms(llama_131072['ms_per_step'])} against {ms(hf_131072['ms_per_step'])} ms).
With full recompute our LoopCoder, which runs its 16 layers twice, fits {loop_full[0]:,} tokens on the H100, where
transformers' Llama of the same size fits {hf_llama_full[0]:,}. With gradient checkpointing transformers' DeepseekV4
fits {hf_ds_full[0]:,} tokens on the H100, our DeepSeek-V4 with full recompute {ds_full[0] / hf_ds_full[0]:.0f}x that
({ds_full[0]:,}). The bench configs' RoPE is the release attention's (YaRN factor 16 over 4096 positions,
`max_position_embeddings` 65536); for a longer `--seq` the benchmarks give the model `--seq` positions, since the
model refuses a row past its positions.

Not in a result file: the longest row of our DeepSeek-V4 without recompute, and one of our LoopCoder without
recompute past {loop_none[0]:,} tokens. Not probed: our Llama past {llama_full[0]:,} with full recompute, our LoopCoder
between {loop_full[0]:,} and {loop_full[2]:,}, and DeepSeek-V4 with full recompute on an H200."""


def without_result_files() -> str:
    return """## Benchmarks without a result file
- `python3 benchmarks/bench_context_parallel.py --model <loopcoder|deepseek_v4> --seq <S> --cp 2` (weak scaling): one
  GPU on a row of S tokens against `--cp` GPUs (NCCL) on `--cp` x S tokens, in one run, as tokens each GPU trains per
  second (a trainer's call on each rank's share, Megatron's 2 x CP chunks); CPU ranks (gloo) run it in the tests.
- `python3 benchmarks/bench_hyper_connection.py [--profile]`: one DeepSeek-V4 layer's hyper-connections
  ([1, 4096, 4, 2048] bf16, forward + backward, a CUDA graph) as the model's Triton kernels and as compiled torch ops."""


def packed(res: Results) -> str:
    name = "packed_h100"
    rows = []
    labels = {"loopcoder": "LoopCoder (full recompute)", "deepseek_v4": "DeepSeek-V4 `small`"}
    forms = {"packed": "**packed**", "unpacked": "unpacked (one sequence)", "padded": "padded (micro-batch 1)"}
    # each model's latest run (`--models` runs one of them)
    latest = {model: [run for run in res.files[name] if model in run["models"]][-1] for model in labels}
    run = latest["loopcoder"]
    for model, label in labels.items():
        results = latest[model]["models"][model]
        label = f"{label} {res.cite(name, latest[model])}"
        for form, form_label in forms.items():
            r = results[form]
            versus = "1.00" if form == "packed" else f"**{results[f'packed_vs_{form}']:.2f}**"
            tokens = f"**{r['real_tokens_per_s']:,.0f}**" if form == "packed" else f"{r['real_tokens_per_s']:,.0f}"
            rows.append([label, form_label, f"{r['seconds_per_step']:.3f}", tokens, versus,
                         f"{r['peak_reserved_gib']:.1f}", f"{r['first_step_s']:.1f}"])
    lengths, real = run["lengths"], run["real_tokens"]
    slots = max(lengths) * len(lengths)
    deepseek_packed = latest["deepseek_v4"]["models"]["deepseek_v4"]["packed"]
    return f"""## Packed sequences
`python3 benchmarks/bench_packed.py [--models M]`, one {gpu(run)}, each model's latest run:

{table(["model", "form", "s/step", "real tokens/s", "packed vs this form", "peak reserved GiB", "first step s"], rows)}

The samples: {len(lengths)}, lengths log-uniform in [256, 16384] (seed 10): {real:,} real tokens, {min(lengths):,} to
{max(lengths):,} per sample. bf16, forward + backward of the summed per-token loss through the GPTModel call with
`labels`, `attention="fast"`, {' and '.join(sorted({str(r['steps']) for r in latest.values()}))} timed steps (each run's
`--steps`) after one untimed step. The three forms carry the same tokens:
- packed: the samples in one row with `packed_seq_params` (THD; each sample's slot padded to a multiple of 128);
  each sample attends only to itself;
- unpacked: one plain causal sequence of {real:,} tokens (what a trainer without packing support would run for the
  same tokens; the samples attend across their boundaries);
- padded: each sample right-padded to the longest ({max(lengths):,}) with a `[b, 1, 1, s]` padding mask, one row per
  micro-batch: {slots:,} token slots for {real:,} real tokens.
LoopCoder is the dense benchmark's config (hidden 2048, 16 layers, both loops) with full activation recompute, one
layer per checkpoint; DeepSeek-V4 is the `small` config above, without recompute.

What limits it, and what would move it:
- Packed LoopCoder: the full recompute runs every layer's forward twice, and the global attention within each sample
  grows with the square of its length. Selective recompute, where it fits, would move it.
- Unpacked: causal attention over the whole row does the cross-sample work that packing skips (quadratic in the
  row's length for LoopCoder's global attention; for DeepSeek-V4, the CSA indexer scores over all of the row's
  compressed entries), and holds its memory.
- Padded: {1 - real / slots:.0%} of the token slots are padding, computed like real tokens.
- Packed DeepSeek-V4's peak ({deepseek_packed['peak_reserved_gib']:.1f} GiB reserved) is that of a
  {real / 1000:.0f}k-token row without recompute; smaller packed rows per micro-batch lower it."""


def conversion(res: Results) -> str:
    held_name, own_name = "conversion_cpu_page_reporting_held_off", "conversion_cpu"
    held, own = res.run(held_name), res.run(own_name, command_lacks="--against")
    against = res.run(own_name, "--against")
    labels = {"modelzoo import": "`modelzoo import` (HF -> torch_dist, bf16, TP 1)",
              "modelzoo export": "`modelzoo export` (torch_dist -> HF)",
              "export from memory": "export from memory (no kernel-side copies)"}

    def cell(r: dict) -> str:
        rounds = " ".join(f"{ratio:.2f}" for ratio in r["time_vs_baseline_per_round"])
        return f"{r['time_vs_baseline']:.2f}x, {r['seconds']:.2f} s ({rounds}), {r['peak_rss_above_start_gib']:.2f} GiB"

    rows = []
    for timing in ("in process", "CLI"):
        by_held = {r["step"]: r for r in held["results"][timing]}
        by_own = {r["step"]: r for r in own["results"][timing]}
        first = next(iter(by_held.values()))
        rows.append([timing, "baseline: read + write with safetensors", f"{first['baseline_seconds']:.2f} s",
                     f"{next(iter(by_own.values()))['baseline_seconds']:.2f} s"])
        for step, label in labels.items():
            if step in by_held:
                rows.append([timing, label, cell(by_held[step]), cell(by_own[step])])
    imp, exp = (next(r for r in held["results"]["in process"] if r["step"] == s) for s in ("modelzoo import", "modelzoo export"))
    memory = next(r for r in held["results"]["in process"] if r["step"] == "export from memory")
    cli_imp = next(r for r in held["results"]["CLI"] if r["step"] == "modelzoo import")
    cli_exp = next(r for r in held["results"]["CLI"] if r["step"] == "modelzoo export")
    layers = {run_name: run["command"].split("--layers ")[1].split()[0] for run_name, run in ((held_name, held), (own_name, own))}
    header = ["timing", "step", f"reporting held off, {held['checkpoint_gib']:.2f} GiB checkpoint {res.cite(held_name, held)}",
              f"the VM's settings, {own['checkpoint_gib']:.2f} GiB checkpoint {res.cite(own_name, own)}"]
    steps = [r for run in (held, own) for timing in run["results"].values() for r in timing]
    cpu_share = [r["cpu_seconds"] / r["seconds"] for r in steps]
    own_ratios = [ratio for timing in own["results"].values() for r in timing for ratio in r["time_vs_baseline_per_round"]]
    return f"""## Checkpoint conversion (CPU)
`python benchmarks/bench_conversion.py --layers <L> --rounds <R>` on a 2-core CPU VM, files on its disk: with its free
page reporting held off (as root, in `/sys/module/page_reporting/parameters`: `min_free_ms`
{held['page_reporting']['min_free_ms']} and `max_waiting_mib` {held['page_reporting']['max_waiting_mib']}; {layers[held_name]}
layers) and with the VM's own settings ({layers[own_name]} layers). Each file records the settings. Each cell: the
median over the rounds of the step's time over its own round's baseline (per-round ratios in brackets), the step's
median seconds, and the largest peak RSS above the step's start:

{table(header, rows)}

The checkpoint: a synthetic LoopCoder-shaped bf16 checkpoint (hidden 2048, `--layers` layers, vocab 32000) in shards
of 512 MiB. The baseline reads every tensor with safetensors (`safe_open`) and writes the same bytes into the same
shards (`save_file`). Two timings:
- **in process**: the conversion alone (`_import_rank` / `_export_rank` of `conversion/cli.py`, what `modelzoo import`
  / `export` run at TP 1), in a child that has imported its libraries and converted the shipped tiny LoopCoder
  checkpoint first; each round times the baseline and then the step in that child, after one pair not reported.
- **CLI**: the whole command in a fresh process, interpreter and library start-up included.

Every timed step starts after `sync`, with its input in the page cache; peak RSS is the step's own peak (VmHWM reset
at its start) above its starting RSS. CPU time is {min(cpu_share):.2f}-{max(cpu_share):.2f}x the wall time in every
step: the steps are CPU-bound, not waiting on the disk. The conversion targets are wall time <= 1.5 x the
read-and-write baseline and peak RSS <= 1 GB above the process baseline.

What limits it, and what would move it:
- The copy itself. At TP 1 most of an import or export is the kernel copying tensor bytes between files
  (`os.copy_file_range`, on a worker thread while the writer prepares the next tensors; docs/conversion.md); the rest
  is per-tensor Python (torch.save's records, Megatron's planner and its process groups). "Export from memory", the
  same export writing each tensor from its memory map, is the A/B of that copy: {memory['time_vs_baseline']:.2f}x
  against {exp['time_vs_baseline']:.2f}x with reporting held off.
- The VM's free page reporting: memory the guest frees (the page cache of a deleted output, a freed buffer) is handed
  to the host, and the next write into it faults it back in. Which step pays for that varies by round, so with the
  VM's settings single rounds range from {min(own_ratios):.2f}x to {max(own_ratios):.2f}x. On a machine that keeps
  its memory, the held-off figures apply.
- The whole command: each CLI step takes {cli_imp['seconds'] - imp['seconds']:.1f} s more than the same conversion in
  process, where the baseline command takes {cli_imp['baseline_seconds'] - imp['baseline_seconds']:.1f} s more than its
  in-process copy: the command's start-up, chiefly importing Megatron-Core, transformers' modeling code and torch's
  distributed-checkpoint machinery. It does not grow with the checkpoint. See "CLI start-up".
- Not measured here: TP > 1, DeepSeek-V4's quantised formats, a checkpoint of real size.

`--against CHECKOUT` times another commit's in-process import and export in the same run, each right after ours on
the same files, and divides our ratio to the baseline by theirs: against the commit its run names
{res.cite(own_name, against)}, {', '.join(f"{step} {ratio:.2f}x" for step, ratio in against['against']['time_vs_against'].items())}."""


def cli_startup(res: Results) -> str:
    name = "cli_startup"
    run = res.run(name)
    labels = {"help": "`modelzoo --help`", "list": "`modelzoo list`",
              "refused_missing_folder": "refused input: `modelzoo import /nonexistent OUT`",
              "refused_tp": "refused layout: `modelzoo import tiny_checkpoints/llama-tiny OUT --tp 3`",
              "import_modelzoo": "`python -c \"import modelzoo\"`",
              "tiny_import": "tiny import: `modelzoo import tiny_checkpoints/llama-tiny OUT`"}
    names = {"torch": "torch", "megatron_core": "Megatron-Core", "transformers_modeling": "transformers' modeling code"}
    rows = []
    for key, label in labels.items():
        c = run["commands"][key]
        heavy = ", ".join(names[m] for m, imported in c["imports"].items() if imported) or "nothing heavy"
        median = f"**{c['median_s']:.2f} s**" if heavy == "nothing heavy" else f"{c['median_s']:.2f} s"
        rows.append([label, median, f"{c['min_s']:.2f}-{c['max_s']:.2f} s", heavy])
    refused = run["commands"]["refused_tp"]["median_s"]
    fast = run["commands"]["help"]["median_s"]
    return f"""## CLI start-up
`python benchmarks/bench_cli_startup.py --runs 5` {res.cite(name, run)}, on a 2-core CPU VM: wall time from process
start to exit, median of {run['runs_per_command']} fresh processes (fastest and slowest beside it), and which heavy
libraries the command imported (one more run under `python -X importtime`):

{table(["command", "median", "range", "imports"], rows)}

The CLI imports the architecture registry only; a config imports the code of the one architecture it names, and a
conversion imports neither transformers' modeling code nor the other architectures.

What limits the two slow rows:
- A layout refusal needs the model's config, read through transformers' config class, and
  `transformers.configuration_utils` imports torch (through `modeling_rope_utils`). Checking layouts from the raw
  `config.json` before any import would bring its {refused:.2f} s to the {fast:.2f} s of the other refusals, at the
  price of a second, torch-free copy of each architecture's layout rules.
- The tiny import is Megatron-Core's import (it pulls in `torch._dynamo` and `torch.distributed.tensor`) and torch's
  distributed checkpointing; the conversion of the tiny checkpoint itself is a small part of it."""


def provenance(res: Results) -> str:
    rows = []
    for name, number in res.numbers.items():
        runs = res.files[name]
        cells = [[], [], [], [], []]
        for index, run in enumerate(runs, 1):
            versions = ", ".join(f"{package} {version}" for package, version in run["versions"].items())
            label = f"{number}.{index}: " if len(runs) > 1 else ""
            for cell, value in zip(cells, (f"{label}`{run['command']}`",
                                           run["commit"] + (" *" if "provenance_note" in run else ""),
                                           run["date"], run["machine"], versions or "not recorded")):
                cell.append(value)
        rows.append([f"[{number}]", f"`{name}.json`", *("<br>".join(cell) for cell in cells)])
    return f"""## Provenance
Source [n] above is result file n in `benchmarks/results/`, [n.k] its run k. A commit marked * was recorded after the
run; the run's `provenance_note` says from where.

{table(["source", "result file", "command", "commit", "date", "machine", "versions"], rows)}"""


def render(folder: Path = RESULTS) -> str:
    res = Results(folder)
    sections = [
        f"""# Performance
Rendered by `python3 benchmarks/render_performance.py` from the result files in `benchmarks/results/` (one per
benchmark, configuration and GPU, each a list of runs; `benchmarks/harness.py`): edit the script's prose or rerun a
benchmark, not this page. Every figure is read from a result file; each table cites its runs as [n], and the
provenance table at the end gives each run's command, commit, date, machine and software versions.""",
        method(res), dense(res), deepseek_v4(res), deepseek_v4_long(res), deepseek_v41(res), loopcoder_long(res),
        longest(res), packed(res), conversion(res), cli_startup(res), without_result_files(), provenance(res)]
    return reflow("\n\n".join(sections)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where docs/performance.md differs from its render")
    args = parser.parse_args()
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            sys.exit(f"{PAGE} differs from its render: python3 benchmarks/render_performance.py")
        return
    PAGE.write_text(page)
    print(f"wrote {PAGE} ({page.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
