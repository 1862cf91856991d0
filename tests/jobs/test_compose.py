"""compose.yaml cannot be run here (no docker): check its shape, and that every Freight service's
command is a real `freight` command with arguments the CLI accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobs.cli.main import build_parser

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_the_services_of_a_deployment(compose: dict) -> None:
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "api", "worker", "flower"} <= set(services)
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["migrate"]["restart"] == "no"
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # The API and the workers must share the database, the broker and the job files.
    envs = [services[name]["environment"] for name in ("migrate", "api", "worker", "flower")]
    for key in ("FREIGHT_DATABASE_URL", "FREIGHT_BROKER_URL", "FREIGHT_STORAGE_URL", "FREIGHT_S3_ENDPOINT_URL"):
        assert len({env[key] for env in envs}) == 1, key
    assert envs[0]["FREIGHT_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert envs[0]["FREIGHT_BROKER_URL"].startswith("redis://")


def test_compose_keeps_job_files_in_its_object_store(compose: dict) -> None:
    """The multi-host shape: job files in the S3 service's bucket, which exists before the API or a worker
    starts; the S3 identity compose gives the store is the one the Freight services sign with."""
    services = compose["services"]
    env = services["api"]["environment"]
    bucket = env["FREIGHT_STORAGE_URL"].removeprefix("s3://").split("/")[0]
    assert env["FREIGHT_STORAGE_URL"].startswith("s3://") and bucket
    assert env["FREIGHT_S3_ENDPOINT_URL"] == "http://s3:8333"
    assert f"-name {bucket}" in " ".join(services["s3-bucket"]["command"])
    assert services["s3-bucket"]["depends_on"]["s3"]["condition"] == "service_healthy"
    for name in ("api", "worker", "worker-cpu"):
        assert services[name]["depends_on"]["s3-bucket"]["condition"] == "service_completed_successfully", name
    server = " ".join(services["s3"]["command"])
    assert f'"accessKey":"{env["AWS_ACCESS_KEY_ID"]}"' in server
    assert f'"secretKey":"{env["AWS_SECRET_ACCESS_KEY"]}"' in server
    assert "-s3.port=8333" in server


def test_every_freight_command_in_compose_parses(compose: dict) -> None:
    parser = build_parser()
    freight_services = {name: s for name, s in compose["services"].items() if "build" in s}
    assert {"migrate", "api", "worker", "worker-cpu", "flower"} <= set(freight_services)
    for name, service in freight_services.items():
        command = service["command"]
        assert command[0] == "freight", name
        args = parser.parse_args(command[1:])  # exits (SystemExit) on an unknown command or flag
        assert callable(args.handler), name
