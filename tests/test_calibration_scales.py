"""K/V statistics, clip methods, and the kv_scales.json round trip with every rejection."""
from __future__ import annotations

import json
import math

import pytest
import torch

from cabinllm.calibration.clip_search import CANDIDATES, SEARCH_METHOD, ClipRule, clearly_lower
from cabinllm.calibration.clips import compute_clips, layer_ranges, mse_clips, percentile_clips, quantization_mse
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.calibration.stats import KVStats, RangeStats, bin_edges, collect_stats
from cabinllm.runtime.errors import ScalesError
from cabinllm.runtime.formats.scales_file import KVScales, LayerRanges, load_scales, load_scales_file, save_scales
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig


def _stats_of(x: torch.Tensor) -> RangeStats:
    stats = RangeStats.empty(1, x.shape[1], x.shape[2])
    stats.update(0, x)
    return stats


def test_range_stats_track_channel_max_and_count_every_value():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, 2, 8, generator=gen), torch.randn(30, 2, 8, generator=gen) * 3
    stats = RangeStats.empty(2, 2, 8)
    stats.update(1, a)
    stats.update(1, b)
    both = torch.cat([a, b]).abs()
    assert torch.equal(stats.channel_amax[1], both.amax(0))
    assert torch.equal(stats.head_amax[1], both.amax(dim=(0, 2)))
    assert torch.all(stats.channel_hist[1].sum(-1) == 80)
    assert stats.layer_hist[1].sum() == 80 * 16 and stats.layer_hist[0].sum() == 0
    assert stats.layer_amax[0] == 0
    # The bin of each value's magnitude: the histogram of channel (1, 3) knows its largest value's bin.
    top = int(stats.channel_hist[1, 1, 3].nonzero().max())
    edges = bin_edges()
    assert edges[top] <= both[:, 1, 3].max() <= edges[top + 1] * 1.0001


def test_percentile_clip_matches_the_true_quantile():
    x = torch.randn(20_000, 1, 8, generator=torch.Generator().manual_seed(1))
    stats = _stats_of(x)
    amax = stats.layer_amax
    want = float(torch.quantile(x.abs().flatten(), 0.999))
    got = float(percentile_clips(stats.layer_hist, amax, 99.9)[0])
    assert -0.005 < got / want - 1 < 0.04  # the upper edge of the quantile's bin; bins are 1.8 % wide
    assert float(percentile_clips(stats.layer_hist, amax, 100)[0]) == float(amax[0])
    per_channel = percentile_clips(stats.channel_hist[0], stats.channel_amax[0], 99.9)
    want_channel = torch.quantile(x.abs(), 0.999, dim=0)
    assert torch.all((per_channel / want_channel - 1 > -0.005) & (per_channel / want_channel - 1 < 0.04))
    with pytest.raises(ValueError, match="percentile"):
        percentile_clips(stats.layer_hist, amax, 0)


def test_mse_clips_of_all_channels_at_once_equal_each_channel_alone():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3000, 2, 4, generator=gen) * torch.tensor([0.5, 1, 3, 9])
    x[:5] *= 20  # a few outliers in every channel
    stats = KVStats(_stats_of(x), _stats_of(x), dialogues=1, tokens=3000)
    clips = compute_clips(stats, "mse")
    for head in range(2):
        for channel in range(4):
            alone = mse_clips(stats.k.channel_hist[0, head, channel], stats.k.channel_amax[0, head, channel])
            assert float(clips.k_channel[0, head, channel]) == pytest.approx(float(alone), rel=1e-12)
    assert clips.k == [float(mse_clips(stats.k.layer_hist[0], stats.k.layer_amax[0]))]

def test_mse_clip_cuts_rare_outliers_and_lowers_the_error():
    x = torch.randn(50_000, 1, 8, generator=torch.Generator().manual_seed(2))
    x[0, 0, 0] = 60.0  # one outlier would cost every other value its resolution
    stats = _stats_of(x)
    amax = float(stats.layer_amax[0])
    clip = float(mse_clips(stats.layer_hist[0], stats.layer_amax[0]))
    assert clip < amax / 3
    errors = quantization_mse(stats.layer_hist[0], torch.tensor([clip, amax], dtype=torch.float64))
    assert errors[0] < errors[1] / 2
    # The histogram estimate agrees with the error of really quantizing the data.
    for c, estimate in zip((clip, amax), errors.tolist()):
        s = c / 127
        real = float(((torch.clamp(torch.round(x / s), -127, 127) * s - x) ** 2).mean())
        assert abs(estimate / real - 1) < 0.2


def test_compute_clips_by_method():
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(4000, 2, 8, generator=gen) * 5, torch.randn(4000, 2, 8, generator=gen)
    stats = KVStats(_stats_of(k), _stats_of(v), dialogues=1, tokens=4000)
    by_max = compute_clips(stats, "max")
    assert by_max.k == [float(k.abs().max())] and by_max.v == [float(v.abs().max())]
    assert by_max.k_clip_rate == [0.0]
    pct = compute_clips(stats, "percentile", 99.0)
    assert pct.k[0] < by_max.k[0] and 0.005 < pct.k_clip_rate[0] < 0.015
    assert pytest.approx(pct.scales().k[0]) == pct.k[0] / 127
    with pytest.raises(ValueError, match="unknown method"):
        compute_clips(stats, "minmax")
    empty = KVStats(RangeStats.empty(1, 2, 8), RangeStats.empty(1, 2, 8))
    with pytest.raises(ValueError, match="no K/V values collected"):
        compute_clips(empty, "max")


def test_collect_stats_measures_what_the_cache_stores(engine):
    dialogues, _ = prepare_dialogues("builtin", "train", 2, 0, engine.tokenizer, max_tokens=48)
    stats = collect_stats(engine.model, dialogues, progress=False)
    assert (stats.dialogues, stats.tokens) == (2, 96)
    layout = engine.model.kv_layout
    assert stats.k.channel_amax.shape == (layout.num_layers, layout.num_kv_heads, layout.head_size)
    assert torch.all(stats.k.layer_amax > 0) and torch.all(stats.v.layer_amax > 0)
    assert torch.all(stats.k.layer_hist.sum(1) == 96 * layout.num_kv_heads * layout.head_size)
    # Same numbers as reading one layer (5; 1 of the tiny model's 3) back from an fp32 cache by hand.
    layer = min(5, layout.num_layers - 2)
    cache = engine.new_cache(KvCacheConfig("fp32"))
    amax = torch.zeros(layout.num_kv_heads, layout.head_size)
    for d in dialogues:
        seq = Sequence()
        cache.allocate(seq, d.token_ids)
        engine.model.forward(d.token_ids, 0, cache, seq)
        k, _ = cache.storage.read(layer, cache.block_table(seq), len(d.token_ids))
        amax = torch.maximum(amax, k.abs().amax(0))
    assert torch.equal(stats.k.channel_amax[layer], amax)


# -- kv_scales.json ------------------------------------------------------------------

def _ranges(layers: int = 2) -> list[LayerRanges]:
    return [LayerRanges([[1.0 + i, 2.0], [0.5, 3.0]], [[0.1, 0.2], [0.3, 0.4 + i]], 0.001, 0.0,
                        [[0.9, 2.0], [0.5, 2.5]] if i == 0 else None, [[0.1, 0.2], [0.3, 0.35]] if i == 0 else None)
            for i in range(layers)]


def _write(path, **changes):
    save_scales(path, KVScales(k=[0.1, 0.2], v=[0.01, 0.3]), "abc", "mse", {"dialogues": 3}, _ranges())
    doc = json.loads(path.read_text())
    for key, value in changes.items():
        doc[key] = value
    path.write_text(json.dumps(doc))
    return doc


def test_scales_file_round_trip(tmp_path):
    path = tmp_path / "kv_scales.json"
    doc = _write(path)
    assert doc["version"] == 2 and doc["equalized"] is False
    first = doc["layers"][0]
    assert first["kv_cache_scaling_factor"] == 0.1 and first["k_amax"] == 3.0 and first["v_head_amax"] == [0.2, 0.4]
    loaded = load_scales_file(path, "abc", 2, kv_shape=(2, 2))
    assert loaded.scales == KVScales(k=[0.1, 0.2], v=[0.01, 0.3])
    assert loaded.scales.shared() == [0.1, 0.3]
    assert loaded.ranges == _ranges() and loaded.method == "mse" and loaded.data == {"dialogues": 3}
    assert load_scales(path, "abc", 2) == loaded.scales


def test_version_1_files_still_load(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"version": 1, "model_fingerprint": "abc", "method": "quick-max", "data": {},
                                "layers": [{"layer": 0, "k": 0.5, "v": 0.25, "kv_cache_scaling_factor": 0.5}]}))
    loaded = load_scales_file(path, "abc", 1)
    assert loaded.scales == KVScales(k=[0.5], v=[0.25]) and loaded.ranges is None


@pytest.mark.parametrize("edit, message", [
    (lambda doc: doc.update(model_fingerprint="other"), "made for model other, not this one"),
    (lambda doc: doc["layers"].pop(1), r"missing layer\(s\) \[1\]"),
    (lambda doc: doc["layers"][1].update(v=float("nan")), "layer 1 v scale nan is not a finite positive"),
    (lambda doc: doc["layers"][0].update(k=0.0), "layer 0 k scale 0.0 is not a finite positive"),
    (lambda doc: doc["layers"][0].update(k=-1.0), "not a finite positive"),
    (lambda doc: doc["layers"][0].update(k="Infinity"), "not a finite positive"),
    (lambda doc: doc["layers"][1].update(k_channel_amax=[[1.0, 2.0]]), "expected \\[kv_heads, head_size\\]"),
    (lambda doc: doc["layers"][1].update(v_channel_amax=[[-1.0, 2.0], [1.0, 1.0]]), "negative or not finite"),
    (lambda doc: doc["layers"][0].update(k_channel_clip=[[float("inf"), 2.0], [1.0, 1.0]]), "negative or not finite"),
    (lambda doc: doc["layers"][0].update(v_channel_clip=[1.0, 2.0]), "v_channel_clip has shape \\[2\\]"),
    (lambda doc: doc.update(version=99), "schema version 99"),
    (lambda doc: doc.pop("layers"), "not a readable kv_scales.json"),
])
def test_scales_file_rejections(tmp_path, edit, message):
    path = tmp_path / "kv_scales.json"
    doc = _write(path)
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalesError, match=message):
        load_scales_file(path, "abc", 2, kv_shape=(2, 2))


def test_layer_ranges_carry_channel_maxima_clips_and_clip_rates():
    gen = torch.Generator().manual_seed(4)
    stats = KVStats(_stats_of(torch.randn(500, 2, 4, generator=gen)), _stats_of(torch.randn(500, 2, 4, generator=gen)))
    clips = compute_clips(stats, "percentile", 99.0)
    (ranges,) = layer_ranges(stats, clips)
    assert ranges.k_channel_amax == stats.k.channel_amax[0].tolist()
    assert all(c < a for c_head, a_head in zip(ranges.k_channel_clip, ranges.k_channel_amax)
               for c, a in zip(c_head, a_head))
    assert math.isclose(ranges.k_clip_rate, clips.k_clip_rate[0]) and ranges.k_clip_rate > 0
    (by_max,) = layer_ranges(stats, compute_clips(stats, "max"))
    assert by_max.v_channel_clip == by_max.v_channel_amax


def test_clip_rules_of_the_kl_search_read_the_statistics():
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(4000, 2, 8, generator=gen) * 5, torch.randn(4000, 2, 8, generator=gen)
    stats = KVStats(_stats_of(k), _stats_of(v), dialogues=1, tokens=4000)
    by_max = compute_clips(stats, "max")
    assert ClipRule("max").name == "max" and ClipRule("percentile", 99.9).name == "percentile-99.9"
    clips = ClipRule("max").clips(stats)
    assert clips.k == by_max.k and clips.v_clip_rate == [0.0]
    assert torch.equal(clips.k_channel, by_max.k_channel)
    assert ClipRule("percentile", 99.0).clips(stats).k == compute_clips(stats, "percentile", 99.0).k
    assert [r.name for r in CANDIDATES][0] == "max" and SEARCH_METHOD == "kl"


def test_a_later_clip_candidate_must_be_clearly_better_to_replace_the_first():
    gen = torch.Generator().manual_seed(5)
    holding = torch.rand(2000, generator=gen) * 0.002
    noise = (torch.rand(2000, generator=gen) - 0.5) * 0.002
    assert clearly_lower(holding * 0.8, holding)  # 20% less KL at every position
    assert not clearly_lower(holding + noise - 0.00001, holding)  # 1% less on average, within the noise
    assert not clearly_lower(holding * 1.2, holding) and not clearly_lower(holding, holding + 0 * noise)
