"""pyverbs.providers: vendor providers (not supported by softrdma; see pyverbs_compat.unsupported)."""
