"""What a fuzzing run counts: frames, how they were made, what the devices answered."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Stats"]


@dataclass
class Stats:
    sent: int = 0
    send_errors: int = 0
    good_icrc: int = 0
    from_peer: int = 0
    to_live_qp: int = 0
    real_key: int = 0
    byte_mutated: int = 0
    legit_ops: int = 0
    recoveries: dict[str, int] = field(default_factory=dict)
    wc_errors: dict[str, int] = field(default_factory=dict)
    async_events: dict[str, int] = field(default_factory=dict)
    mutations: dict[str, int] = field(default_factory=dict)

    def m(self, name: str) -> None:
        self.mutations[name] = self.mutations.get(name, 0) + 1
