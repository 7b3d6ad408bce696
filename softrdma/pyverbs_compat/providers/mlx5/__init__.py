"""pyverbs.providers.mlx5: built from the manifest (see softrdma/pyverbs_compat/unsupported.py)."""
