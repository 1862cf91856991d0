"""Running one shard, by responsibility: context (the worker's context and a run's outcome), attempt
(finishing, handing back or failing the claimed shard), lease (heartbeat and cancel check), requests
(the sampling mapping and the one engine stream loop), prompts (prompt preparation), kinds (plain and
summarize shards) and executor (run_shard, which ties them together)."""
