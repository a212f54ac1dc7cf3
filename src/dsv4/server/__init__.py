"""The OpenAI-compatible server (`dsv4 serve`): an API process (FastAPI + uvicorn: protocol,
tokenizer, chat template, SSE, metrics) and an engine process (scheduler + runner) connected by ZMQ
(ipc.py).

RL hooks (SGLang's names): the request options `return_routed_experts` / `return_indexer_topk`
(routing.py; server flag `--enable-return-routing`) and the admin endpoint
`POST /update_weights_from_disk` (api.py).

Entry point: `dsv4.server.launch.serve(ServerConfig)`. Tests: `pytest tests/server`.
"""
