"""pyverbs.providers.efa: built from the manifest (see softrdma/pyverbs_compat/unsupported.py)."""
