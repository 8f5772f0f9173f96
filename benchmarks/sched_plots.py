"""The scheduler benchmark's two figures, pure functions of ``bench_scheduler.json``.

``peers_vs_b.png`` (when the run had a real peer): graphalloc's whole step with tables
against TokenSpeed's iteration (``sched_tokenspeed.py``) and vLLM's KV-cache manager's step
(``sched_vllm_peer.py``), per panel as below.
``host_us_vs_b.png``: host time per step against running requests B, one panel per
(page size, window, eviction interval), one line per implementation, the targets dashed.
``gpu_us_vs_b.png``: the same grid for GPU time per step, two measures per implementation:
the GPU interval (CUDA events; solid) and the GPU busy time (CUPTI; dashed), both named in
the legend and explained in the caption. Layout from ``figures.finish``; regenerate from a
committed JSON with ``python benchmarks/replot.py``.
"""

from __future__ import annotations

import os

from figures import finish, machine_name, pyplot, set_b_axis, set_log_y, stat

__all__ = ["plot", "FILES"]

FILES = ("host_us_vs_b.png", "gpu_us_vs_b.png", "peers_vs_b.png")
LEGEND = {
    "graphalloc": "graphalloc: one alloc.step per iteration, one CUDA-graph replay",
    "graphalloc_tables": "graphalloc + attention block tables, still one replay",
    "graphalloc_sglang": "graphalloc through its SGLang seam (one step per iteration)",
    "graphalloc_vllm": "graphalloc through its vLLM facade (one step per iteration)",
    "sglang": "SGLang-style eager allocator (own re-implementation)",
    "vllm": "vLLM-style CPU block manager + block-table upload (own re-implementation)",
}
STYLE = {"graphalloc": ("tab:blue", "o"), "graphalloc_tables": ("tab:cyan", "D"),
         "graphalloc_sglang": ("tab:purple", "v"), "graphalloc_vllm": ("tab:green", "P"),
         "sglang": ("tab:red", "s"), "vllm": ("tab:orange", "^")}

HOST_CAPTION = (
    "One seeded continuous-batching trace per panel and B (arrivals, log-normal prompt and "
    "output lengths, an {chunk}-token chunked-prefill budget, requests finishing and being "
    "replaced), replayed by every implementation, which freed and allocated the same "
    "pages at every step (the seams' SWA frees by their engine's window rule). Host time: "
    "perf_counter around the whole step, steps pipelined (no "
    "synchronisation between them), p50 over the measured steps. Eviction interval: the "
    "window rule runs for a decoding request every 1 or every 128 decode tokens.")
GPU_CAPTION = (
    "Solid, GPU interval (p50 over the measured steps): CUDA events around the step's device "
    "work as the host issues it: around graphalloc's one replay, and around the whole step "
    "for the baselines, whose launches interleave with host work, so their interval also "
    "counts the GPU's idle gaps between launches. Dashed, GPU busy (mean over {profile} "
    "profiled steps): CUPTI's record of the time the GPU spent in the step's kernels and "
    "copies (the union of their intervals): the device work alone. Dotted: an empty kernel "
    "in a CUDA graph replayed on an idle GPU, timed like the steps' intervals. Same traces as "
    "host_us_vs_b.png.")


def _panels(cfgs):
    cols = sorted({(c["ps"], c["window"]) for c in cfgs})
    rows = sorted({c["interval"] for c in cfgs})
    return rows, cols


def _series(cfgs, ps, window, interval, impl, value):
    sel = sorted((c for c in cfgs if (c["ps"], c["window"], c["interval"]) == (ps, window,
                                                                              interval)),
                 key=lambda c: c["b"])
    pts = [(c["b"], value(c["impls"][impl])) for c in sel if impl in c["impls"]]
    return [(b, y) for b, y in pts if y is not None]


def _figure(plt, res, kind):
    cfgs = res["configs"]
    rows, cols = _panels(cfgs)
    cuda = res["device_clock"] == "cuda-events"
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.4 * len(cols), 3.5 * len(rows)),
                             squeeze=False, sharex=True)
    floor = stat((res.get("floor") or {}).get("pipelined_gpu_us"))
    for r, interval in enumerate(rows):
        for col, (ps, window) in enumerate(cols):
            ax = axes[r][col]
            for impl in res["impls"]:
                color, marker = STYLE[impl]
                if kind == "host":
                    pts = _series(cfgs, ps, window, interval, impl,
                                  lambda v: stat(v["host_us"]))
                    ax.plot(*zip(*pts, strict=True), color=color, marker=marker,
                            label=LEGEND[impl])
                    continue
                pts = _series(cfgs, ps, window, interval, impl,
                              lambda v: stat(v["gpu_interval_us"]))
                ax.plot(*zip(*pts, strict=True), color=color, marker=marker,
                        label=LEGEND[impl])
                if cuda:
                    pts = _series(cfgs, ps, window, interval, impl,
                                  lambda v: v["profile"].get("busy_us"))
                    ax.plot(*zip(*pts, strict=True), color=color, marker=marker, ms=3,
                            ls="--", lw=1)
            if kind == "host":
                ax.axhline(15, color="0.4", ls="--", lw=1, label="target: 15 us (B <= 256)")
                ax.axhline(30, color="0.4", ls="-.", lw=1, label="target: 30 us (B = 1024)")
                ylabel = "host time per step (us, p50)"
            else:
                if floor:
                    ax.axhline(floor, color="black", ls=":", lw=1)
                ylabel = ("GPU time per step (us)" if cuda
                          else "device part, CPU wall time (us)")
            set_log_y(ax)
            set_b_axis(ax, [c["b"] for c in cfgs],
                       "running requests B" if r == len(rows) - 1 else "")
            if col == 0:
                ax.set_ylabel(ylabel)
            tokens = "every decode token" if interval == 1 else f"every {interval} tokens"
            ax.set_title(f"page size {ps}, window {window}\nwindow eviction {tokens}",
                         fontsize=10)
            ax.grid(True, which="both", alpha=0.25)
    return fig, axes


def _gpu_legend(axes, cuda):
    from matplotlib.lines import Line2D
    handles, labels = axes[0][0].get_legend_handles_labels()
    if cuda:
        handles += [Line2D([], [], color="0.2", lw=1.5),
                    Line2D([], [], color="0.2", lw=1, ls="--")]
        labels += ["solid: GPU interval (CUDA events, see below)",
                   "dashed: GPU busy (CUPTI: kernels and copies only)"]
    handles.append(Line2D([], [], color="black", lw=1, ls=":"))
    labels.append("dotted: empty-graph floor")
    return handles, labels


def plot(res: dict, out_dir: str) -> list[str]:
    """Write both figures into ``out_dir``; the names written (none without matplotlib)."""
    plt = pyplot()
    # the small-pool configuration is not in the sweep
    res = {**res, "configs": [c for c in res.get("configs") or ()
                              if (c.get("prefix") or {}).get("pool") != "small"]}
    if plt is None or not res["configs"]:
        return []
    machine = machine_name(res.get("machine"))
    params = res.get("params") or {}
    cuda = res["device_clock"] == "cuda-events"
    fig, axes = _figure(plt, res, "host")
    finish(fig, os.path.join(out_dir, FILES[0]), title="Scheduler benchmark: host time per "
           f"step against running requests B (lower is better) [{machine}]",
           caption=HOST_CAPTION.format(chunk=params.get("chunk")),
           legend=axes[0][0].get_legend_handles_labels(), ncol=3)
    fig, axes = _figure(plt, res, "gpu")
    caption = (GPU_CAPTION.format(profile=params.get("profile")) if cuda else
               "CPU run: no CUDA events or CUPTI; the device part's CPU wall time.")
    what = ("GPU time per step against running requests B, as an interval and as busy time"
            if cuda else "device part of a step against running requests B, CPU wall time")
    finish(fig, os.path.join(out_dir, FILES[1]), title=f"Scheduler benchmark: {what} [{machine}]",
           caption=caption, legend=_gpu_legend(axes, cuda), ncol=2)
    return list(FILES[:2]) + _peers(plt, res, out_dir, machine)


def _peer_points(sel, name, field):
    """(B, p50) of one peer over the configurations ``sel`` where it was measured."""
    pts = []
    for c in sel:
        rec = (c.get("peers") or {}).get(name) or {}
        if field in rec:
            pts.append((c["b"], rec[field]["p50"]))
    return pts


PEERS = (("tokenspeed", "iteration_us", "tab:brown", "X",
          "TokenSpeed scheduler (its real code): advance + submit + plan"),
         ("vllm", "step_us", "tab:red", "s",
          "vLLM KV-cache manager (its real code): free + get_computed_blocks + "
          "allocate_slots per request"))


def _peers(plt, res, out_dir, machine) -> list[str]:
    """``peers_vs_b.png``: graphalloc + tables against the real peers (p50)."""
    from sched_tokenspeed import graphalloc_key

    cfgs = [c for c in res["configs"] if any(
        field in ((c.get("peers") or {}).get(name) or {}) for name, field, *_ in PEERS)]
    if not cfgs:
        return []
    key = graphalloc_key(res)
    rows, cols = _panels(cfgs)
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.4 * len(cols), 3.5 * len(rows)),
                             squeeze=False, sharex=True)
    for r, interval in enumerate(rows):
        for col, (ps, window) in enumerate(cols):
            ax = axes[r][col]
            sel = sorted((c for c in cfgs if (c["ps"], c["window"], c["interval"]) == (
                ps, window, interval)), key=lambda c: c["b"])
            ga = [(c["b"], stat(c["impls"]["graphalloc_tables"].get(key))) for c in sel
                  if "graphalloc_tables" in c["impls"]]
            hp = [(c["b"], stat((c.get("host_path") or {}).get("host_us"))) for c in sel]
            hp = [(b, y) for b, y in hp if y is not None]
            if ga:
                ax.plot(*zip(*ga, strict=True), color="tab:cyan", marker="D",
                        label="graphalloc: whole step with block tables" + (
                            "" if key == "host_us" else " (less its eager device part)"))
            if hp:
                ax.plot(*zip(*hp, strict=True), color="tab:blue", marker="o", ls="--",
                        label="graphalloc: the same step's host path alone (nothing "
                        "launched)")
            judged = ga if key == "host_us" or not hp else hp
            if judged:
                ax.plot(*zip(*[(b, 10 * y) for b, y in judged], strict=True),
                        color="tab:blue", ls=":", lw=1,
                        label="10x graphalloc's " + ("step" if judged is ga else "host path")
                        + " (the target: a peer above this line)")
            for name, field, color, marker, label in PEERS:
                pts = _peer_points(sel, name, field)
                if pts:
                    ax.plot(*zip(*pts, strict=True), color=color, marker=marker, label=label)
            set_log_y(ax)
            set_b_axis(ax, [c["b"] for c in cfgs],
                       "running requests B" if r == len(rows) - 1 else "")
            if col == 0:
                ax.set_ylabel("host time per iteration (us, p50)")
            ax.set_title(f"page size {ps}, window {window}, eviction interval {interval}",
                         fontsize=10)
            ax.grid(True, which="both", alpha=0.25)
    peers = res.get("peers") or {}
    names = [f"{title} {(peers.get(name) or {}).get('version')}" for name, title in (
        ("tokenspeed", "TokenSpeed's scheduler"), ("vllm", "vLLM's KV-cache manager"))
        if (peers.get(name) or {}).get("available")]
    prefix = (res.get("params") or {}).get("prefix")
    finish(fig, os.path.join(out_dir, FILES[2]), title="Scheduler benchmark: graphalloc "
           f"against {' and '.join(names)}, same trace"
           + (f", prefix caching ({prefix})" if prefix else "") + f" [{machine}]",
           caption="The same seeded trace per panel and B. TokenSpeed is given the trace's "
           "work (arrivals with their prompts, sampled tokens, finishes) and plans each "
           "iteration by its own policy (its forward batch with block tables). vLLM's "
           "manager replays the trace's decisions, called per request as vLLM's scheduler "
           "calls it (its own window rule, its own block ids; block hashing on arrival and "
           "token append is not in its figure). graphalloc replays the trace's decisions as "
           "one step with the batch's block tables. p50 over the measured steps.",
           legend=axes[0][0].get_legend_handles_labels(), ncol=1)
    return [FILES[2]]


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "or benchmarks/replot.py instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
