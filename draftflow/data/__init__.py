"""Training conversations: read sources, apply the target's chat template, write the prepared set.

- :mod:`draftflow.data.sources`: readers for every recipe source kind, normalised to
  ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
- :mod:`draftflow.data.chat`: the target's chat template → token ids + assistant loss mask.
- :mod:`draftflow.data.regenerate`: the target rewrites assistant turns (injected async client).
- :mod:`draftflow.data.prepare`: mixing, split, regeneration, tokenisation → prepared set.
- :mod:`draftflow.data.dataset`: the prepared set on storage: schema, atomic writes, loaders.
- :mod:`draftflow.data.traffic`: served request/response logs of one window, redacted
  (:mod:`draftflow.data.redaction`); :mod:`draftflow.data.segments`: one data folder per window.
"""
