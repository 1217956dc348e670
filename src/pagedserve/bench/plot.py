"""Latency-versus-throughput curves from a load sweep: one line per endpoint, the SLO as a dashed line."""
from __future__ import annotations

import math
import os

from pagedserve.bench.metrics import SLO, Metrics

# (metric attribute, panel title, SLO attribute)
PANELS = (("ttft", "time to first token", "ttft_s"), ("tpot", "time per output token", "tpot_s"),
          ("e2el", "end-to-end latency", "e2el_s"))


def plot_sweep(points: dict[str, list[tuple[str, Metrics]]], slo: SLO, path: str, title: str = "") -> None:
    """points: endpoint label -> [(load label such as "2/s" or "c=8", metrics)], in sweep order."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.4), constrained_layout=True)
    for ax, (key, name, slo_key) in zip(axes, PANELS):
        for i, (label, pts) in enumerate(points.items()):
            color = f"C{i}"
            # Sorted by achieved throughput so each line reads left to right as load grows.
            pts = sorted(((m.output_throughput, getattr(m, key), load) for load, m in pts
                          if getattr(m, key) is not None), key=lambda p: p[0])
            if not pts:
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1].p50 * 1e3 for p in pts], "o-", color=color, label=f"{label} p50")
            ax.plot(xs, [p[1].p99 * 1e3 for p in pts], "^:", color=color, alpha=0.7, label=f"{label} p99")
            for x, p, load in pts:
                ax.annotate(load, (x, p.p50 * 1e3), textcoords="offset points", xytext=(4, -10), fontsize=7,
                            color=color)
        target = getattr(slo, slo_key)
        if target is not None:
            ax.axhline(target * 1e3, color="red", linestyle="--", linewidth=1, label=f"SLO {target * 1e3:g} ms")
        ax.set_title(name)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 200 rather than 2x10^2 on a log axis
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_point_label(rate: float, concurrency: int | None) -> str:
    if math.isinf(rate):
        return f"c={concurrency}" if concurrency else "inf"
    return f"{rate:g}/s" + (f" c={concurrency}" if concurrency else "")
