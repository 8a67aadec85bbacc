"""Serving: the asyncio front-end, the OpenAI-compatible server, `blockmgr
serve`, serving metrics, shutdown and status, the load generator and its
reports. Imports the engine, the core and the simulator (workloads, reports)."""
