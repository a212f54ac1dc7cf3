"""Which data-parallel rank takes a request (`engine/dp_router.py`): "shortest_queue" and the
"cache_aware" router's view of each rank's prefix cache, on prompts of whole and partial pages."""

from __future__ import annotations

import pytest

from dsv4.config.server import ServerConfig
from dsv4.engine.dp_router import BALANCE_SLACK, PrefixRouter, shortest_queue
from dsv4.engine.parallel_ranks import RankSpec

PAGE = 4
A = list(range(100, 112))            # three pages
B = list(range(200, 212))


def test_shortest_queue_takes_the_fewest_then_the_lowest() -> None:
    assert shortest_queue([2, 1, 1]) == 1 and shortest_queue([0, 0]) == 0


def test_chain_names_whole_prefixes_of_full_pages() -> None:
    r = PrefixRouter(2, PAGE, 100)
    a, longer, other = r.chain(A), r.chain(A + [1, 2, 3, 4, 5]), r.chain(A[:4] + B[4:])
    assert len(a) == 3 and longer[:3] == a and len(longer) == 4    # the partial page: none
    assert other[0] == a[0] and other[1:] != a[1:]                # same first page only
    assert r.chain(A[:3]) == []


def test_a_continuation_goes_where_its_prefix_went() -> None:
    r = PrefixRouter(2, PAGE, 100)
    assert r.pick(A, [0, 0]) == 0 and r.pick(B, [1, 0]) == 1
    # B's next turn: rank 1 holds its pages, though rank 0 is now the less loaded
    assert r.pick(B + [7] * 9, [0, 1]) == 1
    assert r.pick(A + [8] * 5, [1, 1]) == 0
    assert r.matched(r.chain(B + [7] * 9), 1) == 5 and r.matched(r.chain(B), 0) == 0
    r.check_integrity()


def test_ties_and_the_balance_slack() -> None:
    r = PrefixRouter(2, PAGE, 100)
    r.pick(A, [0, 0])
    r.pick(A, [0, BALANCE_SLACK + 5])      # rank 0 again: A's pages there
    assert r.pick(A, [BALANCE_SLACK + 1, 0]) == 1, "too loaded: the least loaded takes it"
    assert r.pick(A, [3, 2]) == 1, "both hold A whole: the less loaded one"
    assert r.pick([1, 2, 3], [1, 0]) == 1, "under a page: the shortest queue"


def test_the_view_forgets_its_least_recent_pages() -> None:
    r = PrefixRouter(1, PAGE, capacity_pages=4)
    r.pick(A, [0])
    r.pick(B, [0])                         # 6 pages recorded, 4 kept: A's first two forgotten
    assert r.matched(r.chain(A), 0) == 0 and r.matched(r.chain(B), 0) == 3
    r.check_integrity()
    with pytest.raises(ValueError, match="allowed: >= 1 each"):
        PrefixRouter(2, 0, 10)


def test_bad_method_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"load_balance_method='random' is invalid; allowed: "
                                         r"\['shortest_queue', 'cache_aware'\]"):
        ServerConfig(model="m", load_balance_method="random")
    with pytest.raises(ValueError, match="load_balance_method='x' is invalid"):
        RankSpec("m", "float32", "cpu", "bf16", ServerConfig(model="m").engine_config, 2, False,
                 "tcp://",
                 data_parallel=True, load_balance_method="x")


def test_serve_flags_reach_the_configs() -> None:
    """`dsv4 serve` flags of this module's and the RL servers' knobs reach the server config,
    the engine config and the DP ranks' spec."""
    from dsv4.cli.main import build_parser
    from dsv4.cli.serve import build_config
    from dsv4.server.engine_process import rank_spec

    args = build_parser().parse_args([
        "serve", "--device", "cpu", "--dp-size", "2", "--load-balance-method", "cache_aware",
        "--batch-invariant", "--shared-expert-beside-max-tokens", "4"])
    config = build_config(args)
    assert config.load_balance_method == "cache_aware"
    assert rank_spec(config).load_balance_method == "cache_aware"
    engine = config.engine_config
    assert engine.batch_invariant and engine.shared_expert_beside_max_tokens == 4
    default = build_config(build_parser().parse_args(["serve", "--device", "cpu"]))
    assert default.load_balance_method == "shortest_queue"
    assert not default.engine_config.batch_invariant
    assert default.engine_config.shared_expert_beside_max_tokens is None
