"""PNG charts of calibration ranges and of KV mode accuracy (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from cabinllm.calibration.clips import LayerClips  # noqa: E402
from cabinllm.calibration.evaluate import REFERENCE_MODE, ModeResult  # noqa: E402
from cabinllm.calibration.stats import KVStats  # noqa: E402


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def plot_ranges(stats: KVStats, clips: LayerClips, path: Path) -> None:
    """Per-layer K/V abs-max with the chosen clips, and the share of values each clip cuts."""
    layers = range(len(clips.k))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    top.plot(layers, stats.k.layer_amax.tolist(), "o-", color="tab:blue", label="K abs-max (post-RoPE)")
    top.plot(layers, stats.v.layer_amax.tolist(), "o-", color="tab:orange", label="V abs-max")
    top.plot(layers, clips.k, "--", color="tab:blue", label="K clip")
    top.plot(layers, clips.v, "--", color="tab:orange", label="V clip")
    top.plot(layers, [max(k, v) for k, v in zip(clips.k, clips.v)], ":", color="black",
             label="shared clip (kv_cache_scaling_factor x 127)")
    top.set_yscale("log")
    top.set_ylabel("|x|")
    top.set_title("K/V ranges per layer")
    top.legend(fontsize=8)
    width = 0.4
    bottom.bar([i - width / 2 for i in layers], [100 * r for r in clips.k_clip_rate], width, label="K")
    bottom.bar([i + width / 2 for i in layers], [100 * r for r in clips.v_clip_rate], width, label="V")
    if not any(clips.k_clip_rate + clips.v_clip_rate):
        bottom.text(0.5, 0.5, "no value clipped (the clips are the measured abs-max)", ha="center",
                    transform=bottom.transAxes)
    bottom.set_ylabel("values clipped (%)")
    bottom.set_xlabel("layer")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_kind_ranges(kinds: dict, clips: LayerClips, path: Path) -> None:
    """Per-layer K and V abs-max at text and at image or audio positions (cabinllm.calibration.clips.kind_ranges)
    beside the layer's clip."""
    layers = range(len(clips.k))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, name, clip in ((axes[0], "k", clips.k), (axes[1], "v", clips.v)):
        for kind, style in zip(kinds, ("o-", "s-", "^-")):
            ax.plot(layers, kinds[kind][f"{name}_amax"], style,
                    label=f"{name.upper()} abs-max at {kind} positions ({kinds[kind]['positions']})")
        ax.plot(layers, clip, "--", color="black", label=f"{name.upper()} clip")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(f"{name.upper()} at {' and '.join(kinds)} positions", fontsize=10)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("|x|")
    fig.tight_layout()
    _save(fig, path)


def plot_accuracy(results: dict[str, ModeResult], path: Path, title: str) -> None:
    """Perplexity change, KL and top-1 agreement of each KV mode against full precision, and KL by position."""
    modes = [m for m in results if m != REFERENCE_MODE]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    panels = [("perplexity vs full precision (%)", [results[m].ppl_delta_pct for m in modes]),
              ("mean KL(full || mode)", [results[m].kl for m in modes]),
              ("top-1 agreement (%)", [100 * results[m].top1_agree for m in modes])]
    for ax, (label, values) in zip(axes, panels):
        bars = ax.bar(modes, values, color="tab:blue")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=35, labelsize=8)
    axes[2].set_ylim(min(95.0, min(100 * results[m].top1_agree for m in modes) - 1) if modes else 95.0, 100.5)
    buckets = list(results[REFERENCE_MODE].by_position)
    for m in modes:
        axes[3].plot(buckets, [results[m].by_position[b].kl for b in buckets], "o-", label=m)
    axes[3].set_yscale("log")
    axes[3].set_title("mean KL by position", fontsize=10)
    axes[3].set_xlabel("token position")
    axes[3].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)
