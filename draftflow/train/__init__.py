"""Training drafters from the shard store; `python -m draftflow.train` is the torchrun entry point.

Its stdout protocol: JSON metric lines (:mod:`draftflow.train.metrics`), then one line
``RESULT_PREFIX + json`` summarising the run; exit code ``EXIT_INTERRUPTED`` after SIGTERM wrote a
checkpoint. The Prefect task reads exactly this.
"""

RESULT_PREFIX = "DRAFTFLOW_RESULT "
EXIT_INTERRUPTED = 143
EXIT_REFUSED = 2  # the run cannot start as asked (the one-line error says why and what to do)
