"""Each tutorial's picture (docs/tutorials/NN-*.md, "The picture") is the sequence diagram
of a run of that tutorial's operations (tests/tutorial_pictures.py): regenerated here and
compared, so a change in what softrdma puts on the wire shows up in the pages' pictures
(``python tests/tutorial_pictures.py --write`` rewrites them)."""

from __future__ import annotations

import pytest

from . import tutorial_pictures as tp


@pytest.mark.parametrize("number", sorted(tp.SCENARIOS))
def test_the_picture_is_the_run(number):
    have = tp.current(number)
    assert have is not None, f"{tp.page(number).name} has no generated picture"
    assert have == tp.block(number), f"{tp.page(number).name}: run " \
        "`python tests/tutorial_pictures.py --write` and look at the change"


def test_the_lost_packet_is_drawn_lost():
    assert "-xP2: WRITE_MIDDLE psn 101 (lost)" in tp.current(10)
    assert "CM REQ" in tp.current(12) and "CM RTU" in tp.current(12)
