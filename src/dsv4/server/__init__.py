"""The OpenAI-compatible server (`dsv4 serve`): an API process (FastAPI + uvicorn: protocol,
tokenizer, chat template, SSE, metrics) and an engine process (scheduler + runner) connected by ZMQ
(ipc.py).

Entry point: `dsv4.server.launch.serve(ServerConfig)`. Tests: `pytest tests/server`.
"""
