"""A queue model whose checkpoint the engine cannot load (a config.json of model_type "falcon"), with a
real `freight api` and `freight worker`: the worker stays up (no exit into a restart loop) and records the
model as one the engine cannot load; the job queued before that fails at once with the loader's message
on the job and its rows; `freight models list` shows the refusal; a new job for the model is a 422 with
the loader's message and field "model"."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from jobs.cli.client import FreightAPIError, FreightClient
from tests.service.fixtures import (
    FREIGHT_BIN,
    ServiceEnv,
    create_api_key,
    make_service_env,
    start_api,
    start_worker,
)

pytestmark = pytest.mark.slow
REFUSAL = "unsupported architecture 'falcon'"


@pytest.fixture(scope="module")
def falcon_env(
    tmp_path_factory: pytest.TempPathFactory,
    pg_url: str,
    redis_url: str,
    queue_prefix: str,
    tiny_llama_dir: Path,
    falcon_dir: Path,
) -> ServiceEnv:
    """The session's database and Redis; the falcon folder is one of the models the API accepts."""
    return make_service_env(
        tmp_path_factory.mktemp("falcon-service"),
        pg_url,
        redis_url,
        f"{queue_prefix}-falcon",  # still under the session prefix, so its queues are cleaned up
        str(tiny_llama_dir),
        (str(falcon_dir),),
    )


@pytest.fixture(scope="module")
def client(falcon_env: ServiceEnv, log_dir: Path) -> Iterator[FreightClient]:
    process, url = start_api(falcon_env, log_dir)
    with FreightClient(url, create_api_key(falcon_env, "falcon")) as freight:
        yield freight
    process.stop()


def test_a_worker_for_a_model_the_engine_cannot_load_stays_up_and_fails_its_jobs(
    client: FreightClient, falcon_env: ServiceEnv, falcon_dir: Path, log_dir: Path
) -> None:
    table = pa.table({"prompt": [f"Say {i}" for i in range(6)]})  # two shards of 4
    queued = client.submit(table, model=str(falcon_dir), max_tokens=4)  # not recorded yet: accepted
    assert queued["status"] == "queued"

    worker = start_worker(falcon_env, log_dir, "falcon", "--model", str(falcon_dir))  # answers a ping
    try:
        done = client.wait(queued["id"], poll_seconds=0.5, timeout=120)
        assert done["status"] == "failed", done
        assert done["error"].startswith(f"model {str(falcon_dir)!r} cannot be served: {REFUSAL}")
        assert done["request_counts"] == {"total": 6, "completed": 0, "failed": 6}
        errors = client.results_table(queued["id"]).column("error").to_pylist()
        assert errors == [done["error"]] * 6

        with pytest.raises(FreightAPIError) as refused:
            client.submit(table, model=str(falcon_dir), max_tokens=4)
        assert refused.value.status_code == 422 and refused.value.param == "model"
        assert REFUSAL in refused.value.message and "supported model types are llama" in refused.value.message

        listing = subprocess.run(
            [FREIGHT_BIN, "models", "list"],
            env=falcon_env.subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        line = next(line for line in listing.splitlines() if line.startswith(f"{falcon_dir}  "))
        assert f"falcon: model {str(falcon_dir)!r} cannot be served: {REFUSAL}" in line

        assert worker.alive()
        log = worker.output()
        assert "consuming its queue to fail the shards queued for it" in log and "Traceback" not in log
    finally:
        worker.stop()
