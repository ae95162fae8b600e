"""PNG figures of a cabin-bench run: speed against context, TTFT per dialogue turn, KV bytes and capacity."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(results: dict, name: str) -> dict:
    """Solid for ours, dashed for peers; one colour per system, the same in every figure."""
    from matplotlib import colormaps

    names = [r["name"] for r in results["runners"]]
    base = name.removesuffix(" (reuse)")
    index = names.index(base) if base in names else len(names)
    shade = (2 * index) % 20 + (index % 20 >= 10)  # tab20's dark shades first, then its light ones
    return {"linestyle": "-" if name.startswith("cabin") else "--", "marker": "o", "markersize": 4,
            "color": colormaps["tab20"](shade)}


def plot_speed(results: dict, path: Path) -> None:
    """Decode and prefill tokens/s against context length, one line per system."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    runners = list(dict.fromkeys(r["runner"] for r in results["speed"]["rows"]))
    for ax, metric, title in zip(axes, ("decode_tok_s", "prefill_tok_s"), ("decode", "prefill")):
        for name in runners:
            rows = [r for r in results["speed"]["rows"] if r["runner"] == name and r[metric] is not None]
            ax.plot([r["context"] for r in rows], [r[metric] for r in rows], label=name, **_style(results, name))
        ax.set_xlabel("context tokens")
        ax.set_ylabel(f"{title} tokens/s (median, log scale)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{title} speed")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"{results['machine']['cpu']}, {results['machine']['torch_threads']} thread(s)", fontsize=9)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(results: dict, path: Path) -> None:
    """TTFT per turn of the dialogue for every system, with the history length."""
    plt = _pyplot()
    turns = results["multiturn"]["turns"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in turns[0]["ttft_s"]:
        points = [(t["turn"], t["ttft_s"][name] * 1000) for t in turns if t["ttft_s"][name] is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **_style(results, name))
    ax.set_xlabel("turn")
    ax.set_xticks([t["turn"] for t in turns])
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    context = ax.twinx()
    context.plot([t["turn"] for t in turns], [t["context_tokens"] for t in turns], color="grey", alpha=0.4,
                 label="history tokens")
    context.set_ylabel("history tokens", color="grey")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("multi-turn TTFT: reuse of earlier turns vs the peers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv(results: dict, path: Path) -> None:
    """KV bytes per token and the longest context in the budget, one bar per system."""
    plt = _pyplot()
    rows = [r for r in results["kv_memory"] if "error" not in r]
    names = [r["runner"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.4 * len(rows) + 1.5), sharey=True)
    colors = ["tab:blue" if n.startswith("cabin") else "tab:grey" for n in names]
    axes[0].barh(names, [r["bytes_per_token"] for r in rows], color=colors)
    axes[0].set_xlabel("KV bytes per token")
    axes[1].barh(names, [r["max_tokens"] for r in rows], color=colors)
    axes[1].set_xlabel(f"longest context in {results['settings']['kv_budget_mib']} MiB (tokens)")
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_figures(results: dict, folder: Path) -> dict[str, Path]:
    """Write every figure the results allow into folder; title -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {"KV bytes per token and capacity": folder / "cabin_bench_kv.png",
           "Prefill and decode speed against context": folder / "cabin_bench_speed.png"}
    plot_kv(results, out["KV bytes per token and capacity"])
    plot_speed(results, out["Prefill and decode speed against context"])
    if results.get("multiturn"):
        out["Multi-turn time to first token"] = folder / "cabin_bench_ttft.png"
        plot_ttft(results, out["Multi-turn time to first token"])
    return out
