"""Transport benchmark: measured payload bytes and the issue's line."""

from verl_memopd.bench import __main__ as bench


def test_transport_benchmark_ends_with_the_issue_line(capsys):
    assert bench.main(["transport", "--hidden", "64", "--vocab", "1000", "--k", "8", "--tokens", "5"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    hidden, logits, topk = 64 * 2, 1000 * 2, 8 * 8 + 4  # bf16 states, bf16 logits, int32 + fp32 pairs + tail
    assert (
        last
        == f"transport bytes_per_token hidden={hidden} logits={logits} topk={topk} exact_ratio={logits / hidden:.2f}"
    )
