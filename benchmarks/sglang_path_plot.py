"""The plot of ``benchmarks/sglang_path.py``'s result (matplotlib only; no torch, no SGLang):
host us per iteration inside the allocator, SGLang's against graphalloc's, per
configuration, and the device ops each issues per iteration."""

from __future__ import annotations

__all__ = ["plot", "main"]


def plot(result: dict, path: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"B{r['batch']} ps{r['page_size']}\nW{r['window']} I{r['interval']}" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10, len(rows) * 0.55), 7), sharex=True)
    width = 0.4
    for ax, key, title in ((ax1, "allocator_us", "host us per iteration inside the allocator"),
                           (ax2, "allocator_ops_per_iter", "device ops per iteration")):
        ax.bar([i - width / 2 for i in x], [r["sglang"][key] for r in rows], width,
               label="SGLang's allocator")
        ax.bar([i + width / 2 for i in x], [r["graphalloc"][key] for r in rows], width,
               label="graphalloc's allocator")
        ax.set_yscale("log")
        ax.set_title(f"{title} ({result['device']})", fontsize=9)
        ax.legend(fontsize=8)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Draw sglang_path.json as a PNG.")
    ap.add_argument("result", help="a sglang_path.json written by benchmarks/sglang_path.py")
    ap.add_argument("png", help="where to write the plot")
    args = ap.parse_args(argv)
    with open(args.result) as f:
        plot(json.load(f), args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
