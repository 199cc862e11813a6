"""Writer subprocess for the crash test: reconcile, then write every planned shard.

    python tests/store/store_writer_loop.py ROOT OPTIONS_JSON NUM_SAMPLES SAMPLES_PER_SHARD HIDDEN

Prints ``ready`` once its imports are done (so the parent's kill lands in the writing, not in
``import torch``), and ``done`` at the end. Samples are deterministic from their ids.
"""

from __future__ import annotations

import json
import sys

import store_synthetic as syn

from draftflow.store import Store, reconcile, write_shard


def main(root: str, options: str, num_samples: int, per_shard: int, hidden: int) -> None:
    print("ready", flush=True)
    store = Store.at(root, json.loads(options))
    plan = reconcile(store, syn.expected(num_samples), per_shard, verify=False)
    for shard in plan.to_generate:
        samples = [syn.sample(s, hidden_size=hidden, n_layers=4) for s in shard.sample_ids]
        write_shard(
            store, shard.shard_id, samples, syn.info(hidden_size=hidden, n_layers=4), attempt=shard.attempt
        )
    print("done", flush=True)


if __name__ == "__main__":
    root_, options_, n_, s_, h_ = sys.argv[1:]
    main(root_, options_, int(n_), int(s_), int(h_))
