"""The weight sync's gather of FSDP2's row-sharded parameters on gloo: equal to
``DTensor.full_tensor`` (uneven and empty pieces included) without going through it,
since on gloo it reaches the coalesced all-gather of issue 38's native crash."""

from __future__ import annotations

from .common import run_ranks
from .workers import gather_rows_like_full_tensor


def test_row_sharded_weights_gather_like_full_tensor_through_plain_all_gather() -> None:
    ranks = run_ranks(gather_rows_like_full_tensor, 2)
    # the cases do cover uneven pieces and an empty one
    assert ranks[0]["local_rows"]["uneven"] == 3 and ranks[1]["local_rows"]["uneven"] == 2
    assert ranks[1]["local_rows"]["one_row"] == 0
    for rank in ranks:
        assert all(rank["equal"].values()), rank["equal"]
        assert rank["replicated_equal"]
        # only the replicated tensor (not row-sharded) goes through full_tensor
        assert rank["full_tensor_calls"] == ["(Replicate(),)"], rank["full_tensor_calls"]
