"""Reduce-scatter: the first half of the two-shot all-reduce kernel."""
