"""pyverbs.providers: vendor providers (not supported by softrdma; see _stub)."""
