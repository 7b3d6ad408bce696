"""libibverbs enumerations (``ibv_qp_state``, ``IBV_QPS_RTS``...), as pyverbs'
``pyverbs.libibverbs_enums``. Defined in :mod:`softrdma.enums` (so the protocol core can use
them without importing the verbs API) and re-exported here unchanged::

    from softrdma.verbs_api import IBV_QPS_RTS, ibv_qp_state
    assert IBV_QPS_RTS is ibv_qp_state.IBV_QPS_RTS
"""

from ..enums import *  # noqa: F401,F403
from ..enums import __all__  # noqa: F401
from ..enums import ALL_ENUMS  # noqa: F401
