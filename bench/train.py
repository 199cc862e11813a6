"""Training benchmark: throughput on real SmolLM2 hidden states, and DFlash attention scaling.

    .venv/bin/python bench/train.py                       # both parts (after `make demo`)
    .venv/bin/python bench/train.py --part scaling        # attention scaling only

Part 1 (throughput): DFlash and Eagle3 trained for a few steps with the real trainer loop
on the demo recipe's shard store (vLLM-extracted SmolLM2 hidden states); prints tokens/s
and the step time split into data wait and compute. Target: data wait <= 5% of step time.

Part 2 (scaling): one DFlash training step (forward + backward, SmolLM2 sizes, 1 layer,
block 8) at sequence lengths 1k/2k/4k/8k with 256 anchors, and at 256/512/1024/3072
anchors with 8k tokens — draftflow's attention (context part + in-block part merged by
log-sum-exp) next to a dense-mask baseline ([A·B, T + A·B] boolean mask + SDPA) measured
in the same run. Each point runs in a fresh subprocess so peak RSS is its own; the baseline
is skipped where its score matrix alone would not fit in memory, and says so.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "smollm2-135m-dflash-cpu.yaml"
H, HEADS, KV, HD, B = 576, 9, 3, 64, 8
DENSE_LIMIT_BYTES = 8 << 30


def throughput(recipe: str, steps: int) -> list[dict]:
    from draftflow.paths import RunLayout
    from draftflow.plan import Plan
    from draftflow.sample_source import open_source
    from draftflow.train import drafter, loop
    from draftflow.train.runtime import init_runtime

    rows = []
    for kind, overrides in (("dflash", []), ("eagle3", ["drafter={kind: eagle3, draft_vocab_size: 8192}"])):
        plan = Plan.load(recipe, overrides + [f"training.log_every={steps}", "training.epochs=50"])
        setup = drafter.build(plan)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = loop.train(
                setup,
                open_source(plan),
                RunLayout(tmp),
                init_runtime("cpu"),
                plan.recipe.training,
                max_steps=steps,
            )
            seconds = time.perf_counter() - t0
        m = _last_metrics(result)
        rows.append(
            {
                "drafter": kind,
                "steps": result.steps,
                "seconds": round(seconds, 1),
                "tokens_per_s": round(m["tokens_per_s"], 1),
                "data_wait_pct": round(100 * m["data_wait_frac"], 2),
            }
        )
    return rows


def _last_metrics(result) -> dict:
    return result.last_metrics


def dense_mask_attention(q, k, v, ctx_k, ctx_v, lo, hi, scale, impl="dense"):
    """The baseline: one boolean mask [A·B, T + A·B] and SDPA over all keys."""
    import torch
    import torch.nn.functional as F

    bt, a, b, nh, hd = q.shape
    t, nkv = ctx_k.shape[1], ctx_k.shape[2]
    keys = torch.cat([ctx_k, k.reshape(bt, a * b, nkv, hd)], 1)
    vals = torch.cat([ctx_v, v.reshape(bt, a * b, nkv, hd)], 1)
    rep = nh // nkv
    keys, vals = keys.repeat_interleave(rep, 2), vals.repeat_interleave(rep, 2)
    qi = torch.arange(a * b, device=q.device) // b
    kpos = torch.arange(t, device=q.device)
    lo_q, hi_q = lo.repeat_interleave(b, 1), hi.repeat_interleave(b, 1)  # [Bt, A·B]
    ctx_mask = (kpos >= lo_q[..., None]) & (kpos < hi_q[..., None])
    blk_mask = qi[:, None] == qi[None, :]
    mask = torch.cat([ctx_mask, blk_mask.expand(bt, -1, -1)], -1)[:, None]  # [Bt, 1, A·B, T+A·B]
    out = F.scaled_dot_product_attention(
        q.reshape(bt, a * b, nh, hd).transpose(1, 2),
        keys.transpose(1, 2),
        vals.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(1, 2).reshape(bt, a, b, nh, hd)


def one_point(seq: int, anchors: int, impl: str) -> dict:
    """A training step of a 1-layer DFlash (SmolLM2 sizes) on random states; runs in its own process."""
    import torch

    import draftflow.models.dflash.model as dflash_model
    from draftflow.models.common import PackedBatch
    from draftflow.models.dflash.config import DFlashConfig

    if impl == "dense-mask":
        dflash_model.dflash_attention = dense_mask_attention
    torch.manual_seed(0)
    cfg = DFlashConfig(
        vocab_size=49152,
        hidden_size=H,
        intermediate_size=1536,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV,
        head_dim=HD,
        block_size=B,
        mask_token_id=0,
        num_context_layers=3,
        draft_vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    model = dflash_model.DFlashDrafter(cfg)
    model.attn_impl = "dense"
    batch = PackedBatch(
        input_ids=torch.randint(0, 49152, (1, seq)),
        hidden_states=torch.randn(1, seq, 3, H),
        loss_mask=torch.ones(1, seq, dtype=torch.uint8),
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = dflash_model.dflash_loss(
            model, batch, max_anchors=anchors, gamma=4.0, generator=torch.Generator().manual_seed(0)
        )
        out.loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seq": seq,
        "anchors": anchors,
        "impl": impl,
        "step_s": round(min(times), 3),
        "peak_rss_mb": round(peak / 1024, 1),
        "rss_growth_mb": round((peak - base) / 1024, 1),
    }


def dense_bytes(seq: int, anchors: int) -> int:
    q = anchors * B
    return HEADS * q * (seq + q) * 4 * 3  # scores, softmax and its gradient in fp32


def scaling() -> list[dict]:
    points = [(s, 256) for s in (1024, 2048, 4096, 8192)] + [(8192, a) for a in (512, 1024, 3072)]
    rows = []
    for seq, anchors in points:
        for impl in ("draftflow", "dense-mask"):
            if impl == "dense-mask" and dense_bytes(seq, anchors) > DENSE_LIMIT_BYTES:
                rows.append(
                    {
                        "seq": seq,
                        "anchors": anchors,
                        "impl": impl,
                        "step_s": None,
                        "peak_rss_mb": None,
                        "note": f"skipped: needs ~{dense_bytes(seq, anchors) >> 30} GiB",
                    }
                )
                continue
            proc = subprocess.run(
                [sys.executable, __file__, "--point", f"{seq},{anchors},{impl}"],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if proc.returncode != 0:
                rows.append(
                    {"seq": seq, "anchors": anchors, "impl": impl, "note": proc.stderr.strip()[-200:]}
                )
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def print_table(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k in keys) + " |")


def ratios(rows: list[dict]) -> None:
    by = {(r["seq"], r["anchors"], r["impl"]): r for r in rows}
    print("\nratio dense-mask / draftflow (same run):")
    for (seq, anchors, impl), r in by.items():
        d = by.get((seq, anchors, "dense-mask"))
        if impl == "draftflow" and d and d.get("step_s"):
            print(
                f"  T={seq} A={anchors}: time x{d['step_s'] / r['step_s']:.2f}, "
                f"peak RSS x{d['peak_rss_mb'] / r['peak_rss_mb']:.2f}"
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["all", "throughput", "scaling"], default="all")
    p.add_argument("--recipe", default=str(DEMO))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--point")
    args = p.parse_args()
    if args.point:
        seq, anchors, impl = args.point.split(",")
        print(json.dumps(one_point(int(seq), int(anchors), impl)))
        return
    if args.part in ("all", "throughput"):
        print("## throughput on SmolLM2 hidden states (demo store)")
        print_table(throughput(args.recipe, args.steps))
    if args.part in ("all", "scaling"):
        print("\n## DFlash step: draftflow attention vs dense-mask baseline")
        rows = scaling()
        print_table(rows)
        ratios(rows)


if __name__ == "__main__":
    main()
