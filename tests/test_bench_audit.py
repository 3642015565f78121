"""Audit benchmark: runs end to end at a tiny size (bf16, so the fp32 reference runs) and ends with its line."""

import re

from verl_memopd.bench import __main__ as bench

LINE = re.compile(
    r"audit check_over_old_check=([\d.e+-]+) audit_step_over_old_audit_step<=([\d.e+-]+) "
    r"audit_step_over_step<=([\d.e+-]+)"
)


def test_audit_benchmark_ends_with_its_line(capsys):
    assert (
        bench.main(
            ["audit", "--dtype", "bfloat16", "--episodes", "2", "--layers", "1", "--warmup", "0", "--repeats", "1"]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    assert all(float(x) > 0 for x in match.groups())
    shape = dict(kv.split("=") for kv in lines[0].split()[2:])
    assert shape["dtype"] == "bfloat16" and int(shape["alone_tokens"]) > int(shape["packed_tokens"])
