"""All-gather: concatenate every rank's tensor along dim 0, bitwise."""
