"""pyverbs.librdmacm_enums (rdma-core 50 on; before, pyverbs.cm_enums): the same module as
pyverbs.cm_enums, every release's names, softrdma.rdmacm's own event and port-space classes."""

from .cm_enums import *  # noqa: F401,F403
from .cm_enums import __all__  # noqa: F401
