"""Talking to vLLM servers over HTTP, and the CPU connector vLLM loads (this package imports nothing at import time)."""
