"""bench_frees' three figures, pure functions of ``bench_frees.json``.

``step_frees.png``        a step of B segment frees against B: the eager and fused baselines
                          looped B times against one graphalloc replay; GPU and host time
``step_frees_decode.png`` the same with one decode token per request (bars when the run
                          measured a single B, as a time-budgeted run may)
``single_free.png``       one segment free against the pages it frees, per page size

graphalloc's GPU panels also draw the host time of its ``run()`` call (dotted): the GPU
interval starts with the start event, and when ``run()`` outlasts the L2 flush queued
before it, the GPU idles inside the interval until the launch arrives, so there the
interval measures the host, not the GPU (the captions say it, with the run's numbers).
Layout from ``figures.finish``; ``python benchmarks/replot.py`` regenerates a committed run.
"""

from __future__ import annotations

import os

from figures import finish, machine_name, pyplot, set_b_axis, set_log_y, stat

__all__ = ["write_plots", "FILES"]

FILES = ("step_frees.png", "step_frees_decode.png", "single_free.png")
LINES = (  # implementation, legend, colour, marker
    ("eager", "eager: the baseline's Torch ops for each free (3 at page size 1, else 8)",
     "tab:red", "s"),
    ("fused", "fused: one lookup-and-clear kernel for each free", "tab:orange", "^"),
    ("graphalloc", "graphalloc: the whole step as one CUDA-graph replay", "tab:blue", "o"),
)
RUN_LABEL = "graphalloc run(): host time of the call inside its GPU interval"
FLOOR_LABEL = "floor: an empty kernel in a CUDA graph"
CLOCKS = (
    "GPU time: CUDA events around one CUDA-graph replay (the baselines' calls are captured "
    "into a graph too), a {flush} MiB L2-evicting write queued before each sample. Host "
    "time: enqueue time (graphalloc: plan() + run()). Lines p50, bands p20-p80, "
    "{samples} samples each.")
CPU_CLOCKS = (
    "CPU run: no CUDA device, so no graphs, events or L2 flush; the kernels' Torch twins run "
    "eagerly, and the device time is the CPU wall clock of that, not GPU time. Host time: "
    "enqueue time (graphalloc: plan() + run()). Lines p50, bands p20-p80, {samples} samples "
    "each. A smoke run: it checks the code paths, not the speed.")
HOST_IN_INTERVAL = (
    "Where graphalloc's GPU line follows its dotted run() line, the interval holds host "
    "time: the host's run() call outlasted the L2 flush queued before the interval, and the "
    "GPU waited for the launch.")


def _find(records, **match):
    return next((r for r in records or () if all(r.get(k) == v for k, v in match.items())),
                None)


def _lines(ax, recs, x_key, key, res, with_run):
    for impl, label, color, marker in LINES:
        pts = sorted((r[x_key], r[key]) for r in recs if r["impl"] == impl and r.get(key))
        if not pts:
            continue
        xs = [x for x, _ in pts]
        ax.plot(xs, [stat(s) for _, s in pts], color=color, marker=marker, label=label)
        ax.fill_between(xs, [stat(s, "p20") for _, s in pts],
                        [stat(s, "p80") for _, s in pts], color=color, alpha=0.15)
    if with_run:
        pts = sorted((r[x_key], r["run_us"]) for r in recs
                     if r["impl"] == "graphalloc" and r.get("run_us"))
        if pts:
            ax.plot([x for x, _ in pts], [stat(s) for _, s in pts], color="tab:blue", ls=":",
                    lw=1.5, label=RUN_LABEL)
    floor = stat((res.get("floor") or {}).get(key))
    if floor:
        ax.axhline(floor, ls="--", color="gray", lw=1, label=FLOOR_LABEL)


def _grid(plt, res, groups, x_key, x_label, unit):
    """Columns: the groups; rows: GPU time, host time."""
    cuda = res["config"].get("device_clock") == "cuda-events"
    fig, axes = plt.subplots(2, len(groups), figsize=(4.3 * len(groups), 6.6), squeeze=False)
    device = "GPU time" if cuda else "device time (CPU wall clock)"
    for col, (title, recs) in enumerate(groups):
        for row, (key, what) in enumerate((("gpu_us", device), ("cpu_us", "host time"))):
            ax = axes[row][col]
            _lines(ax, recs, x_key, key, res, with_run=key == "gpu_us" and cuda)
            set_log_y(ax)
            set_b_axis(ax, [r[x_key] for r in recs], x_label)
            if col == 0:
                ax.set_ylabel(f"{what.split(' (')[0]} per {unit} (us)")
            ax.set_title(f"{title}\n{what}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
    return fig, axes


def _legend(axes):
    seen: dict = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    return list(seen.values()), list(seen)


def _bars(plt, res, recs, cases):
    """Steps measured at a single B: per (ps, pages) case a bar per implementation, GPU and
    host time side by side (lines through one point would show nothing)."""
    fig, axes = plt.subplots(1, 2, figsize=(max(9.5, 3.2 * len(cases) * 2), 3.8),
                             squeeze=False)
    width = 0.8 / len(LINES)
    for ax, (key, what) in zip(axes[0], (("gpu_us", "GPU"), ("cpu_us", "host")), strict=True):
        for i, (impl, label, color, _) in enumerate(LINES):
            xs, ys, err = [], [], [[], []]
            for c, (ps, pages) in enumerate(cases):
                rec = _find(recs, impl=impl, page_size=ps, pages=pages)
                if not rec or not rec.get(key):
                    continue
                s = rec[key]
                xs.append(c + (i - (len(LINES) - 1) / 2) * width)
                ys.append(stat(s))
                err[0].append(stat(s) - stat(s, "p20"))
                err[1].append(stat(s, "p80") - stat(s))
            if xs:
                bar = ax.bar(xs, ys, width, color=color, label=label, yerr=err, capsize=3)
                ax.bar_label(bar, fmt="%.0f", padding=2, fontsize=8)
        floor = stat((res.get("floor") or {}).get(key))
        if floor:
            ax.axhline(floor, ls="--", color="gray", lw=1, label=FLOOR_LABEL)
        set_log_y(ax)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"page size {ps}, {pages} page(s) per segment"
                            for ps, pages in cases])
        ax.set_ylabel(f"{what} time per step (us, p50)")
        ax.set_title(f"{what} time", fontsize=10)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    return fig, axes


def _single_note(res) -> str:
    """The run's own cross-check: a one-page free timed in both sections (the same work)."""
    notes = []
    for ps in sorted({r["page_size"] for r in res.get("single_free", ())}):
        one = _find(res.get("single_free"), impl="graphalloc", page_size=ps, pages=1)
        step = _find(res.get("steps"), impl="graphalloc", B=1, page_size=ps, pages=1,
                     decode=False)
        if not (one and step and one.get("run_us") and step.get("run_us")):
            continue
        g1, g2 = stat(one["gpu_us"]), stat(step["gpu_us"])
        if g1 > 2 * g2:
            notes.append(
                f"At page size {ps} one free of one page measured {g1:.1f} us of GPU interval "
                f"here, with run() taking {stat(one['run_us']):.0f} us on the host, and "
                f"{g2:.1f} us in the step section (B = 1: the same work, same frozen shape), "
                f"with run() taking {stat(step['run_us']):.0f} us.")
    return " ".join(notes)


def write_plots(res: dict, out_dir: str) -> list[str]:
    """Write the figures the results allow into ``out_dir``; the names written."""
    plt = pyplot()
    if plt is None:
        res.setdefault("skipped", []).append("plots: matplotlib is not installed")
        return []
    cfg = res.get("config") or {}
    machine = machine_name(res.get("machine"))
    cuda = cfg.get("device_clock") == "cuda-events"
    clocks = (CLOCKS if cuda else CPU_CLOCKS).format(flush=cfg.get("flush_mib"),
                                                     samples=cfg.get("samples"))
    written = []
    for decode, name in ((False, FILES[0]), (True, FILES[1])):
        recs = [r for r in res.get("steps", []) if r["decode"] == decode]
        cases = sorted({(r["page_size"], r["pages"]) for r in recs})
        if not cases:
            continue
        what = ("a step of B segment frees" + (" and B decode tokens" if decode else ""))
        skipped = [s for s in res.get("skipped", ()) if ("+decode" in s) == decode
                   and s.startswith("step B=")]
        cut = (f" {len(skipped)} of the run's cases of this kind were skipped when it reached "
               "--time-budget-s (listed under 'skipped' in the JSON)." if skipped else "")
        if len({r["B"] for r in recs}) == 1:  # one point per line: bars, not lines
            b = recs[0]["B"]
            fig, axes = _bars(plt, res, recs, cases)
            finish(fig, os.path.join(out_dir, name), title=f"One step of B = {b} segment frees"
                   + (f" and {b} decode tokens" if decode else "") + ": the baselines loop "
                   f"over the frees, graphalloc replays one graph [{machine}]",
                   caption=clocks.replace("Lines p50, bands p20-p80", "Bars p50, whiskers "
                                          "p20-p80") + f" Only B = {b} was measured." + cut,
                   legend=_legend(axes))
        else:
            groups = [(f"page size {ps}, {pages} page(s) per segment",
                       [r for r in recs if (r["page_size"], r["pages"]) == (ps, pages)])
                      for ps, pages in cases]
            fig, axes = _grid(plt, res, groups, "B", "B (requests freeing a segment)", "step")
            finish(fig, os.path.join(out_dir, name),
                   title=f"{what[0].upper()}{what[1:]}: the baselines loop over the B frees, "
                   f"graphalloc replays one graph [{machine}]",
                   caption=clocks + (" " + HOST_IN_INTERVAL if cuda else "") + cut,
                   legend=_legend(axes))
        written.append(name)
    recs = res.get("single_free", [])
    sizes = sorted({r["page_size"] for r in recs})
    if sizes:
        groups = [(f"page size {ps}", [r for r in recs if r["page_size"] == ps])
                  for ps in sizes]
        fig, axes = _grid(plt, res, groups, "pages", "pages freed", "free")
        why = (
            "Why graphalloc can sit above the baselines for one free: it runs a whole "
            "allocator step for it, a graph of two kernels (release, then allocation), against "
            "one fused kernel or a few small eager ops; that fixed cost per call pays off when "
            "a step carries many frees (step_frees.png). " + HOST_IN_INTERVAL)
        note = _single_note(res)
        finish(fig, os.path.join(out_dir, FILES[2]), title="One SWA segment free: eager Torch "
               f"ops, one fused kernel, or a graphalloc step replay [{machine}]",
               caption=clocks + ("\n" + why + (" " + note if note else "") if cuda else ""),
               legend=_legend(axes))
        written.append(FILES[2])
    return written


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_frees.py or "
            "benchmarks/replot.py instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
