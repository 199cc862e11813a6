"""bench/peer_train.py: the table it prints names the CPU it was measured on (ratios against
the reference trainer move between hosts, so a table without its host cannot be compared)."""

from __future__ import annotations

from pathlib import Path


def test_host_names_the_cpu_model_and_its_widest_vector_isa(bench_module):
    host = bench_module("peer_train").host_cpu()
    info = Path("/proc/cpuinfo").read_text()
    model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
    assert host.startswith(f"{model}, ")
    widest = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    assert host.endswith(f"CPUs, {widest}")
