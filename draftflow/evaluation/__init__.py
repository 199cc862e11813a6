"""Acceptance evaluation: an offline simulator and the real vLLM server, one report schema.

- ``report``: AcceptanceReport / Evaluation (JSON, markdown, chart, agreement, gate).
- ``offline``: greedy speculative decoding with the target in transformers (exact vLLM counting).
- ``in_vllm``: the target served by vLLM with the checkpoint as drafter; spec-decode counters.
- ``contract``: the exported folder against the trainer's ``provenance.json``.
- ``run``: ``evaluate_checkpoint`` (recipe's held-out prompts → all of the above → report files).
"""
