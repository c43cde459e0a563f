"""Runtime port blocks (`prewarm.registry.embedded.claim_port_block`): a block one process holds is not handed to
another, whatever ports it has not bound yet; `prewarm up` and the test workers claim their agents' blocks so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prewarm.core.errors import TemporaryError
from prewarm.registry.embedded import claim_port_block

# two blocks below `prewarm up`'s range (20000-30000) and the test workers' (30000-32760), so that no concurrent
# claimant walks them: at the top of `prewarm up`'s, a `prewarm up` test on the other worker once held the second
LO, SIZE = 19_960, 8


def test_a_claimed_block_is_not_handed_to_another_process() -> None:
    mine = claim_port_block(SIZE, LO, LO + SIZE)  # a range of one block: the only one
    assert mine == LO
    other = subprocess.run([sys.executable, "-c",
                            "from prewarm.registry.embedded import claim_port_block\n"
                            f"print(claim_port_block({SIZE}, {LO}, {LO + 2 * SIZE}))"],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert int(other.stdout) == LO + SIZE  # the free one, never the block this process holds
    with pytest.raises(TemporaryError, match="no block of 8 free ports"):
        claim_port_block(SIZE, LO, LO + SIZE)  # held here already: not handed out twice in one process either
