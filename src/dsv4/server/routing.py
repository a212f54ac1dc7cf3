"""Routing replay outputs (SGLang's `return_routed_experts` / `return_indexer_topk`, for RL's R3 and
indexer replay): which request options ask for which captured routing, and how a choice's rows are
returned.

A request asks with `return_routed_experts: true` (the experts every layer routed each token to:
`[rows, num_layers, num_experts_per_tok]`, hash layers included) and/or `return_indexer_topk: true`
(the compressed-KV positions each CSA layer's indexer picked: `[rows, num_csa_layers,
index_topk]`, -1 where fewer exist). Rows = prompt + output tokens - 1: one per token the engine
fed (the last sampled token is never fed). Each choice carries
`{"data": base64(little-endian int32 bytes), "shape": [rows, layers, k]}`.

Only non-streaming responses carry them (a streaming request asking is a 400 naming the option),
and only on a server started with `--enable-return-routing` (otherwise a 400 naming the option and
the flag): that flag makes the engine capture routing and turns the prefix cache off, because
prefix tokens served from the cache were never fed, so have no rows. A request in flight across a
weight update (`/update_weights_from_disk`) recomputes its KV with the new weights; the rows it had
already sent keep the old weights' routing.

Test: `pytest tests/server/test_rl_options.py`.
"""

from __future__ import annotations

import base64

from dsv4.server.errors import bad_request
from dsv4.server.ipc import RoutingRows
from dsv4.server.protocol import RoutingArray, SamplingFields

OPTIONS = {"return_routed_experts": "experts", "return_indexer_topk": "indexer"}
"""Request option -> the engine's routing kind."""
FIELDS = {"experts": "routed_experts", "indexer": "indexer_topk"}
"""Routing kind -> the choice field that returns it."""


def requested_routing(body: SamplingFields, enabled: bool) -> list[str]:
    """The routing kinds the request asks for; 400 naming the option when it cannot have them."""
    kinds = []
    for option, kind in OPTIONS.items():
        if not getattr(body, option):
            continue
        if not enabled:
            raise bad_request(f"{option}=true needs a server started with "
                              "--enable-return-routing; allowed: false", option)
        if body.stream:
            raise bad_request(f"{option}=true is not supported with stream=true; allowed: false "
                              "(non-streaming responses only)", option)
        kinds.append(kind)
    return kinds


def choice_routing(rows: dict[str, list[RoutingRows]], kinds: list[str],
                   num_rows: int) -> dict[str, RoutingArray]:
    """The choice fields (`routed_experts`, `indexer_topk`) of the asked `kinds`: the first
    `num_rows` rows the engine sent for each."""
    return {FIELDS[kind]: routing_array(rows.get(kind, []), num_rows) for kind in kinds}


def routing_array(chunks: list[RoutingRows], num_rows: int) -> RoutingArray:
    """Concatenate consecutive row chunks ([n, layers, k] each) and keep the first `num_rows`
    (fewer when the engine fed fewer, e.g. an aborted request)."""
    if not chunks:
        return RoutingArray(data="", shape=[0, 0, 0])
    tail = chunks[0].shape[1:]
    assert all(c.shape[1:] == tail for c in chunks), "routing chunks of different layouts"
    row_bytes = 4 * tail[0] * tail[1]
    total = sum(c.shape[0] for c in chunks)
    rows = min(num_rows, total)
    data = b"".join(c.data for c in chunks)[:rows * row_bytes]
    return RoutingArray(data=base64.b64encode(data).decode("ascii"), shape=[rows, *tail])
