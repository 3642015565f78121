"""KL benchmark: runs end to end at a tiny size and ends with the issue's line."""

import re

from verl_memopd.bench import __main__ as bench

LINE = re.compile(r"kl vocab=(\d+) tokens=(\d+) peak_mem_ratio=([\d.]+) time_ratio=([\d.]+) max_abs_err=([\d.e+-]+)")


def test_kl_benchmark_ends_with_the_issue_line(capsys):
    assert bench.main(["kl", "--vocab", "3001", "--hidden", "16", "--tokens", "70", "--token-chunk", "32",
                       "--vocab-chunk", "1000"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    vocab, tokens, mem, time_ratio, err = match.groups()
    assert (int(vocab), int(tokens)) == (3001, 70)
    assert float(mem) > 0 and float(time_ratio) > 0 and float(err) < 1e-4
    assert any(line.startswith("vocab_chunked") for line in lines)
