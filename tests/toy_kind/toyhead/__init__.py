"""A toy drafter kind: k independent heads on the target's states (Medusa-like)."""
