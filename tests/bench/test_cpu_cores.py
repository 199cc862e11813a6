"""bench/cpu_cores.py compares the two settings it names: only the every-core server gets the
reservation of 0, both get the same model, dtype and flags, and ratios pool all repeats."""

from __future__ import annotations

from draftflow.vllm.launch import build_command, build_env

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def test_the_two_settings_differ_only_in_the_core_reservation(bench_module, tmp_path):
    bench = bench_module("cpu_cores")
    args = bench.parse_args(["--model", "/models/m", "--work-dir", str(tmp_path)])
    default, every = (bench.server_spec(args, reserved) for reserved in bench.SETTINGS.values())
    assert RESERVED not in build_env(default) and build_env(every)[RESERVED] == "0"
    strip = lambda cmd: [a for a in cmd if not a.isdigit()]  # noqa: E731 (the ports differ)
    assert strip(build_command(default)) == strip(build_command(every))
    assert "--no-enable-prefix-caching" in build_command(every)
    served = bench.server_spec(args, 0, drafter="/exports/d")
    assert served.speculative_config == {"model": "/exports/d"} and build_env(served)[RESERVED] == "0"


def test_ratios_pool_tokens_over_seconds_not_rates(bench_module):
    pooled = bench_module("cpu_cores").pooled
    assert pooled([(100, 1.0), (100, 9.0)]) == 20.0  # 200 tokens in 10 s; the mean of the rates: 55.6
