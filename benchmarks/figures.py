"""Figures of benchmarks/ and examples/: the shared layout, and the one-figure plotters.

Every figure is a pure function of a result's JSON (no torch, no graphalloc), so a
committed JSON regenerates its PNG on any machine: ``python benchmarks/replot.py``.

Layout rules (:func:`finish`): a title that says what was measured and on which machine,
axes with units, one figure-wide legend in words above the panels, a caption under them
for what a reader needs to read the numbers (what a band is, what an interval includes);
the figure grows to fit title, legend and caption, so no text is clipped.

Plotters here: :func:`plot_page_tables` (``bench_page_tables.py``),
:func:`plot_decode_loop_bench` (``bench_decode_loop.py``) and
:func:`plot_decode_loop_example` (``examples/model_loops/decode_loop.py``). The bench_frees
figures are
in ``report.py``, the scheduler benchmark's in ``sched_plots.py``; both use this layout.
"""

from __future__ import annotations

import math
import textwrap

__all__ = ["plot_vllm_cost", "pyplot", "finish", "stat", "machine_name", "set_b_axis", "set_log_y",
           "plot_page_tables",
           "plot_decode_loop_bench", "plot_decode_loop_example"]

DPI = 110
MIN_WIDTH_IN = 9.0
CAPTION_PT, LEGEND_PT, TITLE_PT = 9, 9, 12
CHARS_PER_INCH = {CAPTION_PT: 13.5, TITLE_PT: 10.0}  # DejaVu Sans, a safe average


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def stat(stats: dict | None, key: str = "p50"):
    """One quantile of a ``timing.summarize`` record (None for none). Results written
    before the quantiles were renamed call the median ``median``."""
    if not stats:
        return None
    if key == "p50" and "p50" not in stats:
        return stats.get("median")
    return stats.get(key)


def machine_name(machine: dict | None, fallback: str | None = None) -> str:
    """The GPU's name, or ``CPU (<model>)``; ``fallback`` for records that kept no machine."""
    m = machine or {}
    if m.get("gpu"):
        return m["gpu"]
    if m.get("cpu"):
        return f"CPU ({m['cpu']})"
    return fallback or "machine not recorded"


def set_b_axis(ax, values, label: str) -> None:
    """A log2 x axis whose ticks are exactly ``values``, printed as plain numbers."""
    import matplotlib.ticker as mticker
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.xaxis.set_minor_locator(mticker.NullLocator())
    ax.set_xlabel(label)


def set_log_y(ax) -> None:
    """A log y axis labelled at 1, 2, 5 x 10^k in plain numbers (10, 20, 50, 100, ...)."""
    import matplotlib.ticker as mticker
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(mticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(mticker.NullFormatter())


def _wrap(text: str, width_in: float, pt: int) -> list[str]:
    chars = max(20, int(width_in * CHARS_PER_INCH[pt]))
    lines = []
    for para in text.split("\n"):
        lines += textwrap.wrap(para, chars) or [""]
    return lines


def finish(fig, path, *, title: str, caption: str = "", legend=None, ncol: int = 0) -> None:
    """Lay the figure out (title, legend, panels, caption, top to bottom), save, close.

    ``legend``: ``(handles, labels)`` for one figure-wide legend; ``ncol`` 0 picks the
    columns from the label lengths. The figure is made taller by what title, legend and
    caption need, so the panels keep the size the caller gave them."""
    import matplotlib.pyplot as plt
    width_in, panels_in = fig.get_size_inches()
    width_in = max(width_in, MIN_WIDTH_IN)  # room for the legend and the caption
    title_lines = _wrap(title, width_in, TITLE_PT)
    cap_lines = _wrap(caption, width_in - 0.3, CAPTION_PT) if caption else []
    handles, labels = legend if legend else ([], [])
    if labels:  # as many columns as asked for and as fit across the figure
        longest = max(len(s) for s in labels)
        fit = max(1, int(width_in * CHARS_PER_INCH[CAPTION_PT] // (longest + 6)))
        ncol = min(ncol or len(labels), fit, len(labels))
    legend_rows = math.ceil(len(labels) / ncol) if labels else 0
    title_in = 0.12 + 0.25 * len(title_lines)
    top_in = title_in + (0.1 + 0.24 * legend_rows if legend_rows else 0.05)
    bottom_in = 0.12 + 0.19 * len(cap_lines)
    height_in = panels_in + top_in + bottom_in
    fig.set_size_inches(width_in, height_in)
    fig.tight_layout(rect=(0, bottom_in / height_in, 1, 1 - top_in / height_in))
    fig.suptitle("\n".join(title_lines), y=1 - 0.08 / height_in, va="top",
                 fontsize=TITLE_PT)
    if labels:
        fig.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=LEGEND_PT,
                   frameon=False, bbox_to_anchor=(0.5, 1 - title_in / height_in))
    if cap_lines:
        fig.text(0.15 / width_in, 0.08 / height_in, "\n".join(cap_lines), ha="left",
                 va="bottom", fontsize=CAPTION_PT)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _legend_of(axes) -> tuple[list, list]:
    """Handles and labels of every axis, each label once, in first-seen order."""
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    return list(seen.values()), list(seen)


# ---- bench_page_tables.py -------------------------------------------------------------------
PAGE_TABLE_LINES = (  # JSON key, legend, style
    ("tables_csr", "graphalloc page tables, CSR form (one kernel in a CUDA graph)",
     dict(color="tab:blue", marker="o")),
    ("tables_all", "graphalloc page tables, CSR + block-table forms (one kernel)",
     dict(color="tab:cyan", marker="D", ls="--")),
    ("eager", "eager Torch ops building the CSR tables (engines today)",
     dict(color="tab:red", marker="s")),
    ("eager_graph", "the same eager ops captured in one CUDA graph",
     dict(color="tab:orange", marker="^")),
    ("floor", "floor: an empty kernel in a CUDA graph",
     dict(color="gray", marker=".", ls=":")),
)


def plot_page_tables(res: dict, path) -> bool:
    """GPU time per call of each way to write one batch's FULL + SWA tables, per page size."""
    plt = pyplot()
    page_sizes = sorted({r["ps"] for r in res.get("cases", ())})
    if plt is None or not page_sizes:
        return False
    cuda = res.get("device_clock") == "cuda-events"
    fig, axes = plt.subplots(1, len(page_sizes), figsize=(6.2 * len(page_sizes), 4.4),
                             squeeze=False)
    for ax, ps in zip(axes[0], page_sizes, strict=True):
        cases = sorted((r for r in res["cases"] if r["ps"] == ps), key=lambda r: r["b"])
        for key, label, style in PAGE_TABLE_LINES:
            pts = [(r["b"], stat(r["gpu_us"].get(key))) for r in cases]
            pts = [(b, y) for b, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=label, **style)
        set_log_y(ax)
        set_b_axis(ax, [r["b"] for r in cases], "lanes B (requests in the batch)")
        ax.set_ylabel("GPU time per call (us, p50)" if cuda else "CPU wall time per call (us)")
        ax.set_title(f"page size {ps}")
        ax.grid(True, which="both", alpha=0.3)
    p = res.get("params") or {}
    caption = (
        "Each call writes the attention metadata of one decode batch: kv_indptr, kv_indices "
        "and kv_last_page_len for the FULL layers and for the SWA layers (SWA pages inside the "
        f"window only). Lengths lognormal around {p.get('median_len')} tokens, window "
        f"{p.get('window')} tokens. GPU time: CUDA events around one call, a "
        f"{p.get('flush_mib')} MiB L2-evicting write before each sample; p50 of "
        f"{p.get('samples')} samples. "
        + ("Both ways wrote the same tables in every case." if all(
            r.get("outputs_equal") for r in res["cases"]) else
           "THE TWO WAYS WROTE DIFFERENT TABLES in some case (see the JSON)."))
    kernels = sorted({(r.get("launches") or {}).get("eager", {}).get("kernels")
                      for r in res["cases"]} - {None})
    if kernels:
        caption += (f" The eager way launches {kernels[0]:g}"
                    + (f"-{kernels[-1]:g}" if kernels[-1] != kernels[0] else "")
                    + " kernels per call.")
    if not cuda:
        caption += " CPU run: no graphs, times are CPU wall clock of eager execution."
    finish(fig, path, title="Attention page tables: graphalloc's one kernel against the eager "
           f"Torch ops engines use [{machine_name(res.get('machine'))}]", caption=caption,
           legend=_legend_of(axes[0]), ncol=2)
    return True


# ---- bench_decode_loop.py -------------------------------------------------------------------
DECODE_VARIANTS = {
    "in_graph": ("allocator step inside the model's CUDA graph (one replay per step)", "C0"),
    "eager_alloc": ("allocator kernels launched eagerly, then the model-only graph", "C1"),
    "eager": ("no CUDA graph at all", "C2"),
}


def plot_decode_loop_bench(out: dict, path) -> bool:
    """Grouped bars: per (lanes, allocator backend), one bar per variant, three panels."""
    plt = pyplot()
    res = out.get("results") or []
    if plt is None or not res:
        return False
    meta = out.get("meta") or {}
    groups = list(dict.fromkeys((r["batch"], r["backend"]) for r in res))
    variants = [v for v in DECODE_VARIANTS if any(r["variant"] == v for r in res)]
    width = 0.8 / len(variants)
    panels = (("steps_per_s", "decode steps per second", "throughput (higher is better)"),
              ("host_launch_us_per_step", "host time per step (us)",
               "host launch time per decode step"),
              ("gpu_us_per_step", "GPU time per step (us)", "GPU time per decode step"))
    panels = [p for p in panels if all(r.get(p[0]) for r in res)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (key, ylabel, title) in zip(axes[0], panels, strict=True):
        for j, v in enumerate(variants):
            label, color = DECODE_VARIANTS[v]
            xs, ys, lo, hi = [], [], [], []
            for i, g in enumerate(groups):
                rec = next((r for r in res if (r["batch"], r["backend"]) == g
                            and r["variant"] == v), None)
                if rec is None:
                    continue
                s = rec[key]
                xs.append(i + (j - (len(variants) - 1) / 2) * width)
                ys.append(stat(s))
                lo.append(stat(s) - stat(s, "p20"))
                hi.append(stat(s, "p80") - stat(s))
            bars = ax.bar(xs, ys, width, yerr=[lo, hi], color=color, label=label, capsize=2)
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{b} lanes\n{be}" for b, be in groups])
        ax.set_xlabel("decode lanes, allocator backend")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.margins(y=0.12)
        ax.grid(True, axis="y", alpha=0.3)
    machine = machine_name(meta.get("machine"), meta.get("device"))
    floor = stat((meta.get("floor") or {}).get("gpu_us")) or meta.get("empty_graph_floor_us")
    repeats = meta.get("repeats")
    caption = (
        f"Bars: p50, whiskers p20-p80: steps/s over {repeats} interleaved runs of the same "
        "workload, host and GPU time over every decode step of them. Host launch time: lane "
        "inputs + the eager allocator launches (if any) + the replay + mark_submitted "
        "(planning excluded). GPU time: CUDA events around the eager allocator launches and "
        "the replay. The tiny hybrid model of examples/model_loops/paged_decode.py, page size "
        f"{meta.get('page_size')}, window {meta.get('window')}, prompts "
        f"{'-'.join(map(str, meta.get('prompt_len') or ()))} and outputs "
        f"{'-'.join(map(str, meta.get('output_len') or ()))} tokens; "
        + ("every variant generated the same tokens." if all(
            r.get("tokens_equal_across_variants") for r in res) else
           "SOME VARIANTS GENERATED DIFFERENT TOKENS (see the JSON).")
        + (f" Empty-graph replay floor: {floor:.1f} us." if floor else ""))
    finish(fig, path, title="Decode loop: graphalloc's step inside the model's CUDA graph or "
           f"launched before it [{machine}]", caption=caption, legend=_legend_of(axes[0]))
    return True


# ---- examples/model_loops/decode_loop.py -----------------------------------------------------
def plot_decode_loop_example(out: dict, path) -> bool:
    """Per page size: pages in use, SWA pages the window freed, KV memory saved, per step."""
    plt = pyplot()
    runs = out.get("runs") or []
    if plt is None or not runs:
        return False
    import numpy as np
    cfg = out.get("config") or {}
    fig, axes = plt.subplots(len(runs), 3, figsize=(15, 3.0 * len(runs)), squeeze=False)
    for (ax_pages, ax_evict, ax_saved), run in zip(axes, runs, strict=True):
        s, ps = run["summary"]["series"], run["page_size"]
        steps = np.arange(len(s["full_used_pages"]))
        ax_pages.plot(steps, s["full_used_pages"], color="tab:blue",
                      label="FULL pages in use (full-attention layers)")
        ax_pages.plot(steps, s["swa_used_pages"], color="tab:orange",
                      label="SWA pages in use (sliding-window layers)")
        ax_pages.set_ylabel("pages in use")
        ax_pages.set_title(f"page size {ps}: pages in use")
        ax_evict.bar(steps, s["swa_pages_evicted"], width=1.0, color="0.45",
                     label="SWA pages freed by the window in the step")
        ax_evict.set_ylabel("SWA pages freed")
        ax_evict.set_title(f"page size {ps}: SWA pages freed per step")
        saved = np.array([np.nan if x is None else 100 * x for x in s["memory_saved"]])
        ax_saved.plot(steps, saved, color="tab:green",
                      label="KV memory saved against full KV in every layer")
        ax_saved.axhline(100 * run["max_saving"], color="0.5", ls="--", lw=1,
                         label="bound: SWA layers holding nothing")
        ax_saved.set_ylim(0, 100)
        ax_saved.set_ylabel("KV memory saved (%)")
        ax_saved.set_title(f"page size {ps}: KV memory saved")
        for ax in (ax_pages, ax_evict, ax_saved):
            ax.set_xlabel("decode step")
            ax.grid(True, alpha=0.3)
    args = cfg.get("args") or {}
    attention = cfg.get("attention") or "not recorded"
    dtype = cfg.get("dtype", "float32")
    shared = args.get("shared_prompt") or 0
    caption = (
        f"{cfg.get('requests')} requests, {cfg.get('max_batch')} decode lanes, continuous "
        f"batching; model window {(cfg.get('model') or {}).get('window', 'not recorded')} "
        "tokens. The series depend only on the seeded workload and the allocator: the "
        "attention path and the dtype change how the model reads K/V, not what is allocated "
        "or freed."
        + (f" A {shared}-token system prompt is shared from the prefix cache: its pages are "
           "held once, and after the last step only they are left (FULL and SWA alike, so "
           "the saving there is 0)." if shared else
           " After the last step nothing is held, so it has no saving to plot."))
    mode = "one CUDA graph per step" if cfg.get("graph") else "eager launches"
    prompt = f", a {shared}-token system prompt shared" if shared else ""
    finish(fig, path, title=f"Decode loop: the allocator's pages per decode step (attention "
           f"{attention}, {dtype}, {mode}{prompt}) "
           f"[{machine_name(cfg.get('machine'), cfg.get('gpu'))}]",
           caption=caption,
           legend=_legend_of(axes[0]))
    return True


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/replot.py (it "
            "redraws committed plots from their JSON) instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")


def plot_vllm_cost(res: dict, path: str) -> bool:
    """engines/vllm/bench_cost.py: vLLM 0.33's schedule() + update_from_output() per decode
    step and its KV-cache manager's share, vLLM's manager against graphalloc's, cache off
    and on. Returns False when there is nothing to draw."""
    rows = res.get("rows") or []
    if not rows:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, caching in zip(axes, (False, True), strict=True):
        sel = [r for r in rows if r["caching"] == caching]
        bs = [r["batch"] for r in sel]
        for manager, mark in (("vllm", "o"), ("graphalloc", "s")):
            ax.plot(bs, [r[manager]["step_us"] for r in sel], mark + "-",
                    label=f"{manager}: schedule() + update_from_output()")
            ax.plot(bs, [r[manager]["manager_us"] for r in sel], mark + "--",
                    label=f"{manager}: inside the KV-cache manager")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("B (decoding requests)")
        ax.set_title(f"prefix caching {'on' if caching else 'off'}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per step (median)")
    finish(fig, path, title="vLLM 0.33 scheduler on a CPU: its own KV-cache manager "
           "against graphalloc's plug-in", legend=axes[0].get_legend_handles_labels())
    return True

