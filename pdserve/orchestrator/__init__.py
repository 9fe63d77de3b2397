"""The orchestrator side of disaggregated serving: config, global request ids, routers, the
OpenAI-compatible orchestrator, the coordinator + fleet, and `pdserve disaggregated` (cli.py).
The worker side is pdserve.server; docs/disaggregation.md is the contract between them."""
