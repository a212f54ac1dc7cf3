"""SGLang's trainer-facing endpoints: an external trainer pushes new weights into `dsv4 serve`
over a process group, without a checkpoint on disk (the disaggregated placement of Miles and
slime), and pauses / continues generation around its updates.

    POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
        "group_name" (default "weight_update_group"), "backend" ("gloo" | "nccl")}
        the engine joins the group as rank `rank_offset`; the trainer is rank 0, hosts the store
        and joins at the same time (the request returns once every rank has joined)
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
        "flush_cache", "weight_version" (the label /generate reports for the new weights' tokens)}
        the engine takes one broadcast per name from rank 0, in order (the trainer sends them
        while this request is open), then serves the tensors between two steps
        (`LLMEngine.update_weights`: atomic; running requests recompute their KV with the new
        weights; the prefix cache is flushed whatever `flush_cache` says)
        -> {"success", "message", "num_tensors", "weight_version"}
    POST /destroy_weights_update_group {"group_name"}
    POST /pause_generation {"mode": "abort" (default) | "retract" | "in_place"}
        stop stepping: abort every request, or retract the running ones (their KV is freed; they
        recompute when generation continues), or keep them in place with their KV; requests that
        arrive meanwhile wait
    POST /continue_generation {}
    POST /release_memory_occupation {"tags": null | ["kv_cache", "cuda_graph"]}
        an idle engine frees its KV pools and CUDA graphs (a colocated trainer steps meanwhile;
        the weights stay resident: "weights" is refused); requests wait until
    POST /resume_memory_occupation {"tags"}
        allocates them again (the prefix cache empty, graphs re-captured on first use)

Names are those `/update_weights_from_disk` serves (engine/weight_sync.py: the float model's
state-dict names). An update the engine refuses (unknown name, wrong shape, non-finite values) is
a 400 after its tensors were received, so the trainer's broadcasts complete, and the served weights
stay as they were; malformed dtypes or lengths are a 400 before anything is received (the trainer's
broadcasts then fail at the group's timeout). With tp_size or dp_size > 1 the engine process is
rank 0: it alone joins the trainer's group, then hands each of its ranks that rank's part of every
tensor over their own default group (`engine/parallel_weights.py`: one more hop, NCCL between
GPUs); pause, release and resume reach every rank. The backend must suit the device: gloo on the
CPU, NCCL on CUDA. The transport: engine/weight_group.py; the engine process's side:
engine_control.py.

Test: `pytest tests/server/test_weight_update.py`.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from dsv4.engine.weight_group import parse_dtype
from dsv4.server.errors import bad_request
from dsv4.server.ipc import (
    ContinueGeneration,
    DestroyWeightsGroup,
    InitWeightsGroup,
    PauseGeneration,
    ReleaseMemory,
    UpdateWeightsDistributed,
)
from dsv4.server.protocol import RequestBody
from dsv4.server.state import ServerState

GROUP = "weight_update_group"        # SGLang's default group name


class InitGroupRequest(RequestBody):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = GROUP
    backend: str = "nccl"


class UpdateDistributedRequest(RequestBody):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = GROUP
    flush_cache: bool = True
    weight_version: str | None = None


class DestroyGroupRequest(RequestBody):
    group_name: str = GROUP


class PauseRequest(RequestBody):
    mode: str = "abort"


class ContinueRequest(RequestBody):
    pass


class MemoryRequest(RequestBody):
    tags: list[str] | None = None


async def init_group(state: ServerState, body: InitGroupRequest) -> Response:
    reply = await state.client.weights_call(lambda q: InitWeightsGroup(
        q, body.master_address, body.master_port, body.rank_offset, body.world_size,
        body.group_name, body.backend), "backend")
    return JSONResponse({"success": True, "message": reply.message})


async def update_distributed(state: ServerState, body: UpdateDistributedRequest) -> Response:
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise bad_request(f"names, dtypes and shapes differ in length ({len(body.names)}, "
                          f"{len(body.dtypes)}, {len(body.shapes)}); allowed: one per tensor",
                          "names")
    for name in body.dtypes:
        try:
            parse_dtype(name)
        except ValueError as e:
            raise bad_request(str(e), "dtypes") from e
    reply = await state.client.weights_call(lambda q: UpdateWeightsDistributed(
        q, body.names, body.dtypes, body.shapes, body.group_name, body.weight_version), "names")
    return JSONResponse({"success": True, "message": reply.message,
                         "num_tensors": reply.num_tensors, "weight_version": reply.weight_version})


async def destroy_group(state: ServerState, body: DestroyGroupRequest) -> Response:
    reply = await state.client.weights_call(lambda q: DestroyWeightsGroup(q, body.group_name),
                                            "group_name")
    return JSONResponse({"success": True, "message": reply.message})


async def pause(state: ServerState, body: PauseRequest) -> Response:
    reply = await state.client.weights_call(lambda q: PauseGeneration(q, body.mode), "mode")
    return JSONResponse({"success": True, "message": reply.message})


async def resume(state: ServerState, body: ContinueRequest) -> Response:
    reply = await state.client.weights_call(ContinueGeneration, "mode")
    return JSONResponse({"success": True, "message": reply.message})


async def release_memory(state: ServerState, body: MemoryRequest) -> Response:
    reply = await state.client.weights_call(lambda q: ReleaseMemory(q, False, body.tags), "tags")
    return JSONResponse({"success": True, "message": reply.message})


async def resume_memory(state: ServerState, body: MemoryRequest) -> Response:
    reply = await state.client.weights_call(lambda q: ReleaseMemory(q, True, body.tags), "tags")
    return JSONResponse({"success": True, "message": reply.message})
