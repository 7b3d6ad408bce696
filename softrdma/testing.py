from .harness.testing import *  # noqa: F401,F403 -- the old path, kept for code written against it
