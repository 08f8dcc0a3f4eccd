"""Fused all-reduce + residual add + RMSNorm (one kernel per rank): launch.py, kernel.py, reference.py."""
