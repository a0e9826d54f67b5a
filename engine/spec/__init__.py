"""Speculative decoding: drafters, acceptance, and the per-step planner."""
