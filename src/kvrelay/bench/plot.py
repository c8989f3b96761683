"""Stacked bars per agent — prefill / decode / relay — for text and kv mode side by side."""

from __future__ import annotations

from pathlib import Path

PARTS = (("prefill_s", "prefill", "#d95f02"), ("decode_s", "decode", "#7570b3"), ("relay_s", "relay", "#1b9e77"))


def plot_pipeline(result: dict, path: str | Path) -> Path:
    """Write a PNG of ``result`` (a ``bench_pipeline`` dict) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["per_agent"]
    n = len(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * n + 2), 4.2))
    width = 0.38
    for m, (mode, hatch) in enumerate((("text", ""), ("kv", "//"))):
        xs = [i + (m - 0.5) * width for i in range(n)]
        bottom = [0.0] * n
        for key, label, color in PARTS:
            vals = [r[f"{mode}_{key}"] for r in rows]
            ax.bar(xs, vals, width, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                   label=f"{label} ({mode})")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for x, b in zip(xs, bottom, strict=True):
            ax.text(x, b, mode, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(n), [r["agent"] for r in rows], rotation=20)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"{result['workflow']} · {result.get('model', '')} · {result.get('context_tokens', '?')} ctx tokens"
                 f" · {result.get('layout', '')}\ntext {result['text_s']:.1f}s, kv {result['kv_s']:.1f}s, "
                 f"speedup {result['speedup']:.2f}x (ideal {result['ideal_speedup']:.2f}x)", fontsize=9)
    top = max(max(r[f"{m}_prefill_s"] + r[f"{m}_decode_s"] + r[f"{m}_relay_s"] for r in rows) for m in ("text", "kv"))
    ax.set_ylim(0, top * 1.35)  # headroom for the legend
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    return save_figure(fig, path)


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it as a PNG at ``path`` (its folder made if missing) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
