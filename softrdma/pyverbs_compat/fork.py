"""pyverbs.fork: fork_init, is_fork_initialized.

softrdma pins no memory (registered memory is ordinary Python memory), so a forked child
cannot corrupt a registration: fork support is unneeded, as libibverbs reports on kernels
with copy-on-fork for pinned pages (what the lab's rxe guests answer too).
"""

IBV_FORK_DISABLED, IBV_FORK_ENABLED, IBV_FORK_UNNEEDED = 0, 1, 2


def fork_init() -> None:
    """ibv_fork_init: nothing to do (always succeeds)."""


def is_fork_initialized() -> int:
    return IBV_FORK_UNNEEDED
