"""pyverbs, as softrdma: the modules `softrdma run` puts under the name `pyverbs`."""
