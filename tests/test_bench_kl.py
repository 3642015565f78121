"""KL benchmark: runs end to end at a tiny size and ends with the issue's line."""

import re

import torch

from verl_memopd.bench import __main__ as bench

LINE = re.compile(r"kl vocab=(\d+) tokens=(\d+) peak_mem_ratio=([\d.]+) time_ratio=([\d.]+) max_abs_err=([\d.e+-]+)")


def test_kl_benchmark_ends_with_the_issue_line(capsys):
    assert (
        bench.main(
            [
                "kl",
                "--vocab",
                "3001",
                "--hidden",
                "16",
                "--tokens",
                "70",
                "--token-chunk",
                "32",
                "--vocab-chunk",
                "1000",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    vocab, tokens, mem, time_ratio, err = match.groups()
    assert (int(vocab), int(tokens)) == (3001, 70)
    assert float(mem) > 0 and float(time_ratio) > 0 and float(err) < 1e-4
    assert any(line.startswith("vocab_chunked") for line in lines)


def test_cuda_variants_run_on_any_device_and_the_no_top_mass_one_computes_the_same_loss():
    """The CUDA comparison's variant code (run here on the CPU): ours with and without the top-mass
    diagnostics give the same loss and gradients, and agree with naive fp32."""
    from types import SimpleNamespace

    from verl_memopd.bench import kl

    args = SimpleNamespace(seed=0, tokens=40, hidden=16, teacher_hidden=24, vocab=1000)
    x = kl._cuda_inputs(args, device="cpu")
    out = {v: kl._cuda_step(v, x, 16) for v in ("naive/float32", "chunked/float32/16", "chunked_no_top/float32/16")}
    for k in ("loss", "grad_h", "grad_w"):
        assert torch.equal(out["chunked/float32/16"][k], out["chunked_no_top/float32/16"][k])
        torch.testing.assert_close(out["chunked/float32/16"][k], out["naive/float32"][k], rtol=1e-4, atol=1e-6)
