"""Decode-context-parallel attention merge (dcp_merge) and all_gather_heads: launch.py, kernel.py, reference.py."""
