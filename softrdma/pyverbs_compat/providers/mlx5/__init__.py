"""pyverbs.providers.mlx5: built from the manifest (see softrdma/pyverbs_compat/_stub.py)."""
