"""Whole models from Hugging Face checkpoints: config, loading, tensor-parallel decoder."""
