"""Packing benchmark: the work formula, the dispatcher, and the final line."""

import re
import statistics

import pytest
import torch

from verl_memopd.bench import __main__ as bench
from verl_memopd.bench.packing import group_stream, grouped_episodes, layout_work, paired_ratio
from verl_memopd.bench.tiny import teacher_config
from verl_memopd.packing import build_layout
from verl_memopd.rce import EpisodeShape, random_episodes

CONFIG = teacher_config(vocab_size=64)


@pytest.mark.parametrize("name", ["packed", "per_call_varlen"])
def test_layout_work_counts_visible_pairs(name):
    layout = build_layout(name, random_episodes(3, 64, 0, EpisodeShape(prefix_len=(3, 9), chunk_len=(1, 5))))
    h, i, hq, hkv, d = 256, 512, 8, 4, 32
    c_tok = 2 * (h * (hq * d + 2 * hkv * d) + hq * d * h + 3 * h * i)
    pairs = int(layout.segments.visibility().sum())
    assert layout_work(layout, CONFIG) == layout.input_ids.numel() * c_tok + pairs * 4 * hq * d


def test_ideal_is_one_without_sharing_and_above_one_with_it():
    single = random_episodes(4, 64, 1, EpisodeShape(calls=(1, 1)))
    many = random_episodes(4, 64, 1, EpisodeShape(prefix_len=(40, 60), calls=(3, 5), chunk_len=(5, 10)))
    ratio = [
        layout_work(build_layout("per_call_varlen", eps), CONFIG) / layout_work(build_layout("packed", eps), CONFIG)
        for eps in (single, many)
    ]
    assert ratio[0] == pytest.approx(1.0) and ratio[1] > 1.5


def test_dispatcher_lists_benchmarks_for_an_unknown_name(capsys):
    assert bench.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and all(name in err for name in ("packing", "kl", "transport"))


def test_packing_benchmark_ends_with_the_issue_line(capsys):
    threads = str(torch.get_num_threads())  # keep this process's setting
    assert bench.main(["packing", "--episodes", "1", "--warmup", "0", "--repeats", "1", "--threads", threads]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"packing speedup_vs_per_call=(\S+) ideal=(\S+) efficiency=(\S+)", last)
    x, y, efficiency = (float(g) for g in m.groups())
    assert y > 1 and efficiency == pytest.approx(x / y, abs=3e-3)  # values printed with 3 decimals


def test_group_shape_flags_share_q_and_keep_the_last_line(capsys):
    threads = str(torch.get_num_threads())
    assert (
        bench.main(
            [
                "packing",
                "--group-size",
                "2",
                "--q-ratio",
                "1.5",
                "--calls",
                "2",
                "--episodes",
                "2",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--threads",
                threads,
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert "groups of 2 sharing q, 2.0 calls each" in lines[0] and "1.50x mean block" in lines[0]
    assert re.fullmatch(r"packing speedup_vs_per_call=\S+ ideal=\S+ efficiency=\S+", lines[-1])


def test_grouped_episodes_share_one_prompt_and_the_group_stream_stores_it_once():
    eps = grouped_episodes(random_episodes(4, 64, 2, EpisodeShape(prefix_len=(3, 9), chunk_len=(1, 5))), 2, 10, 0, 64)
    assert [ep.uid for ep in eps] == ["group-0", "group-0", "group-1", "group-1"]
    assert eps[0].prefix_ids == eps[1].prefix_ids != eps[2].prefix_ids and len(eps[3].prefix_ids) == 10
    assert all(inv.prompt_ids[:10] == ep.prefix_ids for ep in eps for inv in ep.invocations)
    layout = build_layout("packed", eps)
    stream = group_stream(eps, layout)
    assert stream.input_ids.numel() == layout.input_ids.numel() - 2 * 10
    assert torch.equal(
        stream.input_ids.reshape(-1)[stream.predictors], layout.input_ids.reshape(-1)[layout.action_index]
    )
    assert layout_work(stream, CONFIG) < layout_work(layout, CONFIG)


def test_paired_ratio_is_the_median_of_same_round_ratios():
    # round 2 ran 3x slower for both variants, round 3 for the baseline only: same-round ratios 2, 2, 6 -> 2,
    # where the ratio of the medians (6 / 1) would say 6
    times = {"base": [2.0, 6.0, 6.0], "target": [1.0, 3.0, 1.0]}
    assert paired_ratio(times, "base", "target") == pytest.approx(2.0)
    assert statistics.median(times["base"]) / statistics.median(times["target"]) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        paired_ratio({"base": [1.0], "target": [1.0, 2.0]}, "base", "target")
