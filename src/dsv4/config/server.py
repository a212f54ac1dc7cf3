"""ServerConfig: the frozen knobs of `dsv4 serve` (the `EngineConfig` plus model, HTTP and
admission limits).

Built once at the CLI edge (`dsv4.cli.serve`), where "auto" values — default model, device, dtype,
CPU page size — are resolved before construction; passed to the API process and, through the
spawn arguments, to the engine process, which builds its engine from `engine_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsv4.config.engine import EngineConfig, WeightFormat, check_weight_format

DTYPES = ("bfloat16", "float16", "float32")
# which data-parallel rank takes a request (`engine/dp_router.py`; SGLang's / sgl-router's names)
LOAD_BALANCE_METHODS = ("shortest_queue", "cache_aware")
DEVICES = ("cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ServerConfig(EngineConfig):
    """The `EngineConfig` knobs plus those of the server.

    `model`: checkpoint directory. `served_model_name`: the `model` id clients send and
    `/v1/models` lists. `host`/`port`: where the API listens. `api_key`: when set, `/v1/*`
    requires `Authorization: Bearer <key>`. `max_waiting_requests`: engine requests allowed in
    flight beyond `max_running_requests` before new requests get 503. `max_request_bytes`: larger
    request bodies get 413. `shutdown_timeout_s`: on SIGTERM, how long in-flight requests may
    finish before they are aborted. `access_log`: uvicorn's per-request log. `torch_threads`:
    intra-op threads of the engine process (None: torch's default, one per core).
    `weight_format`: "bf16" dequantises FP4 / FP8 weights at load; "checkpoint" keeps the routed
    experts in FP4. `load_format` (vLLM's and SGLang's name): "auto" reads the checkpoint's
    weights; "dummy" reads only its config.json (and tokenizer) and fills the model with random
    weights in memory (`checkpoint/writer.py::random_model`, seeded by `seed`, default 0): a
    benchmark of a model too large to write to disk (`dsv4 init --no-weights` writes such a
    directory); with several ranks each draws only its shard's values (`distributed/dummy.py`).
    `enable_return_routing`: requests may ask for their routing
    (`return_routed_experts`, `return_indexer_topk`); the engine then captures routing and runs
    without the prefix cache (`engine_config` sets `capture_routing` and `disable_prefix_cache`),
    because prefix tokens served from the cache are never fed, so have no captured routing.
    `tp_size`: tensor-parallel ranks (the engine process is rank 0 and spawns the others;
    `engine/parallel.py`); `ep_size`: 1, or the number of ranks, to split the routed experts by
    id. `dp_size`: data-parallel attention ranks (`engine/data_parallel.py`: each rank serves its
    own requests, the MoE runs over all ranks' tokens); with `dp_size` > 1, `tp_size` is 1.
    `load_balance_method` (SGLang's name): which DP rank takes a request, "shortest_queue" or
    "cache_aware" (the rank whose prefix cache likely holds the most of its prompt;
    `engine/dp_router.py`).
    `nnodes` / `node_rank` / `dist_init_addr` (SGLang's names): the ranks spread over `nnodes`
    machines that rendezvous at `dist_init_addr` ("host:port"); node 0 serves HTTP and runs rank
    0, the others only run their ranks (`engine/parallel_ranks.py::serve_node`).
    """

    model: str = ""
    served_model_name: str = "dsv4"
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int = 1024
    max_request_bytes: int = 16 << 20
    shutdown_timeout_s: float = 10.0
    access_log: bool = False
    torch_threads: int | None = None
    weight_format: WeightFormat = "bf16"
    load_format: str = "auto"
    enable_return_routing: bool = False
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "shortest_queue"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model:
            raise ValueError("model='' is invalid; allowed: a checkpoint directory")
        if not self.served_model_name:
            raise ValueError("served_model_name='' is invalid; allowed: a non-empty name")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid; allowed: {list(DTYPES)}")
        check_weight_format(self.weight_format)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is invalid; "
                             f"allowed: {list(LOAD_FORMATS)}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device={self.device!r} is invalid; allowed: cpu, cuda or cuda:N")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r} is invalid; allowed: 0..65535")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key='' is invalid; allowed: None (no auth) or a non-empty key")
        self._check_limits()

    def _check_limits(self) -> None:
        if not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={self.max_waiting_requests!r} is invalid; "
                             "allowed: an integer >= 0")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes={self.max_request_bytes!r} is invalid; "
                             "allowed: an integer >= 1")
        if self.torch_threads is not None and (not isinstance(self.torch_threads, int)
                                               or self.torch_threads < 1):
            raise ValueError(f"torch_threads={self.torch_threads!r} is invalid; "
                             "allowed: None or an integer >= 1")
        for name in ("tp_size", "dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 1")
        if self.dp_size > 1 and self.tp_size > 1:
            raise ValueError(f"tp_size={self.tp_size} with dp_size={self.dp_size} is not "
                             "supported; allowed: tp_size 1 with data-parallel attention")
        if self.enable_hisparse and max(self.tp_size, self.dp_size) > 1:
            raise ValueError(f"enable_hisparse=True with tp_size={self.tp_size}, dp_size="
                             f"{self.dp_size} is not supported (--enable-hisparse with --tp-size "
                             "/ --dp-size); allowed: tp_size 1 and dp_size 1 with HiSparse on")
        ranks = max(self.tp_size, self.dp_size)
        if self.ep_size not in (1, ranks):
            raise ValueError(f"ep_size={self.ep_size!r} is invalid; allowed: 1 or the number "
                             f"of ranks ({ranks}: tp_size or dp_size)")
        self._check_nodes(ranks)
        check_load_balance_method(self.load_balance_method)
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s={self.shutdown_timeout_s!r} is invalid; "
                             "allowed: >= 0 seconds")

    def _check_nodes(self, ranks: int) -> None:
        if not isinstance(self.nnodes, int) or self.nnodes < 1 or ranks % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes!r} is invalid; allowed: a divisor of the "
                             f"number of ranks ({ranks}: tp_size or dp_size)")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank!r} is invalid; allowed: "
                             f"0..{self.nnodes - 1}")
        addr = self.dist_init_addr
        if self.nnodes > 1 and (addr is None or not _is_host_port(addr)):
            raise ValueError(f"dist_init_addr={addr!r} is invalid with nnodes={self.nnodes}; "
                             "allowed: 'host:port', the same on every node")

    @property
    def engine_config(self) -> EngineConfig:
        """The `EngineConfig` part alone (what `LLMEngine` is built from), with routing captured
        and the prefix cache off under `enable_return_routing`."""
        config = EngineConfig(**{f.name: getattr(self, f.name)
                                 for f in dataclasses.fields(EngineConfig)})
        if self.enable_return_routing:
            config = dataclasses.replace(config, capture_routing=True, disable_prefix_cache=True)
        return config

    @property
    def max_inflight_requests(self) -> int:
        """Engine requests (running + waiting) the API admits before answering 503."""
        return self.max_running_requests + self.max_waiting_requests


def _is_host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def check_load_balance_method(method: str) -> str:
    if method not in LOAD_BALANCE_METHODS:
        raise ValueError(f"load_balance_method={method!r} is invalid; "
                         f"allowed: {list(LOAD_BALANCE_METHODS)}")
    return method
