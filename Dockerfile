# One image for every Freight service (api, worker, flower, migrate); compose.yaml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# a C++ compiler for the CPU kernels (kernels/csrc), compiled on first use; without it the torch paths run
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first and pinned: it is the large layer, and it changes least often.
RUN pip install torch==2.13.0

COPY pyproject.toml README.md ./
COPY jobs ./jobs
COPY worker ./worker
COPY kernels ./kernels
COPY storage ./storage
COPY migrations ./migrations
RUN pip install ".[triton]"

CMD ["freight", "--help"]
