"""pyverbs.libibverbs_enums (the name later rdma-core releases use): same as pyverbs.enums."""

from .enums import *  # noqa: F401,F403
from .enums import __all__  # noqa: F401
