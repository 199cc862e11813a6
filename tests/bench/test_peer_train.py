"""bench/peer_train.py: the table it prints names the CPU it was measured on (ratios against
the reference trainer move between hosts, so a table without its host cannot be compared)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_host_names_the_cpu_model_and_its_widest_vector_isa(bench_module):
    host = bench_module("peer_train").host_cpu()
    info = Path("/proc/cpuinfo").read_text()
    model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
    assert host.startswith(f"{model}, ")
    widest = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    assert host.endswith(f"CPUs, {widest}")


def test_the_3072_anchor_points_run_only_when_asked_for(bench_module):
    peer = bench_module("peer_train")
    default = [pt[0] for pt in peer.select_points("", extended=False)]
    assert "dflash-8k-1024" in default and not any(name.endswith("-3072") for name in default)
    extended = [pt[0] for pt in peer.select_points("dflash-8k,dflash-64k", extended=True)]
    assert extended == ["dflash-8k-512", "dflash-8k-1024", "dflash-8k-3072", "dflash-64k-3072"]
    with pytest.raises(SystemExit, match="no point matches .dflash-64k."):
        peer.select_points("dflash-64k", extended=False)
