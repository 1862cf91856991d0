"""The job domain shared by the API, the CLI and the worker: parameters and schemas, prompts, input
validation, sharding, summarize planning, results, metrics and the HTML job report, the broker names, the job service,
recovery, errors, the sample documents and the settings. It imports no torch, worker or kernels, and
nothing from jobs.api or jobs.cli."""
