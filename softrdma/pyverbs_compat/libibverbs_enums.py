"""pyverbs.libibverbs_enums (rdma-core 50 on; before, pyverbs.enums): the same module as
pyverbs.enums, every release's names (unsupported.SAME_MODULE)."""

from .enums import *  # noqa: F401,F403
from .enums import __all__  # noqa: F401
