"""The `freight` console script, as a user runs it (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from storage.db import make_engine, make_session_factory
from storage.keys import tenant_for_key
from tests.service.fixtures import FREIGHT_BIN, PARKED_MODEL, ServiceEnv


def freight(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([FREIGHT_BIN, *args], env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_help_lists_every_command() -> None:
    out = freight("--help").stdout
    for command in (
        "run",
        "sample-docs",
        "summarize",
        "report",
        "submit",
        "status",
        "results",
        "cancel",
        "jobs",
        "db",
        "keys",
        "api",
        "worker",
        "flower",
        "models",
        "bench",
    ):
        assert f"    {command}" in out, command


def test_api_side_modules_do_not_import_torch_or_the_worker() -> None:
    code = (
        "import sys, jobs.cli.main, jobs.api.app, jobs.cli.client, jobs.domain.service, jobs.domain.summarize; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'worker'); "
        # `freight run`'s module (worker.embedded) imports the engine only when a job runs
        "import worker.embedded; "
        "bad += ['torch (through worker.embedded)'] if 'torch' in sys.modules else []; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_db_upgrade_on_a_new_sqlite_database(tmp_path: Path) -> None:
    env = {
        "PATH": str(Path(sys.executable).parent),
        "FREIGHT_HOME": str(tmp_path / "home"),
        "FREIGHT_DATABASE_URL": f"sqlite:///{tmp_path / 'db' / 'f.db'}",
    }
    assert "revision head" in freight("db", "upgrade", env=env).stdout
    from alembic.script import ScriptDirectory

    from storage.db import alembic_config

    head = ScriptDirectory.from_config(alembic_config(env["FREIGHT_DATABASE_URL"])).get_current_head()
    assert freight("db", "current", env=env).stdout.strip() == head


def test_keys_create_prints_the_key_once_and_stores_a_hash(service_env: ServiceEnv) -> None:
    env = service_env.subprocess_env()
    created = freight("keys", "create", "--tenant", "cli-tenant", env=env)
    key = created.stdout.strip()
    assert key.startswith("frk_") and "cli-tenant" in created.stderr
    engine = make_engine(service_env.settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        assert tenant_for_key(session, key) == "cli-tenant"
    listed = freight("keys", "list", "--tenant", "cli-tenant", env=env).stdout
    assert key.split("_")[1] in listed and key.split("_", 2)[2] not in listed
    freight("keys", "revoke", key.split("_")[1], env=env)
    with make_session_factory(engine)() as session:
        assert tenant_for_key(session, key) is None
    engine.dispose()
    assert freight("keys", "revoke", key, env=env, check=False).returncode == 1


def test_sample_docs(tmp_path: Path) -> None:
    out = tmp_path / "docs.parquet"
    printed = freight("sample-docs", "-o", str(out)).stdout
    assert "freight summarize" in printed and "freight run" in printed
    table = pq.read_table(out)
    assert table.column_names == ["custom_id", "title", "text"] and table.num_rows == 24  # 20 short, 4 long
    assert len(set(table.column("custom_id").to_pylist())) == 24
    freight("sample-docs", "-o", str(out), "--rows", "45")
    assert len(set(pq.read_table(out).column("custom_id").to_pylist())) == 45


def test_remote_commands_against_the_api(
    api_url: str, api_keys: dict[str, str], service_env: ServiceEnv, tmp_path: Path
) -> None:
    env = service_env.subprocess_env(FREIGHT_API_URL=api_url, FREIGHT_API_KEY=api_keys["acme"])
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), source)
    job = json.loads(
        freight(
            "submit", str(source), "--model", PARKED_MODEL, "--max-tokens", "3", "--metadata", "k=v", env=env
        ).stdout
    )
    assert job["status"] == "queued" and job["metadata"] == {"k": "v"} and job["params"]["max_tokens"] == 3
    assert json.loads(freight("status", job["id"], env=env).stdout)["id"] == job["id"]
    assert job["id"] in freight("jobs", "--limit", "100", env=env).stdout
    assert json.loads(freight("metrics", job["id"], env=env).stdout)["rows"] == 3
    freight("results", job["id"], "-o", str(tmp_path / "partial.parquet"), env=env)
    assert pq.read_table(tmp_path / "partial.parquet").num_rows == 0
    assert json.loads(freight("cancel", job["id"], env=env).stdout)["status"] == "cancelling"

    refused = freight("submit", str(source), "--model", "no-such-model", env=env, check=False)
    assert refused.returncode == 1 and "unknown model 'no-such-model'" in refused.stderr
    unauthorized = freight("status", job["id"], env={**env, "FREIGHT_API_KEY": "frk_x_y"}, check=False)
    assert unauthorized.returncode == 1 and "401" in unauthorized.stderr


def test_models_check_describes_a_family_and_refuses_an_unsupported_one(tmp_path: Path, smollm2_path: Path) -> None:
    from tests.worker.engine.families import FAMILIES, build_family
    from worker.engine.loader import load_config
    from worker.engine.parameters import parameter_counts

    moe = build_family(FAMILIES["mixtral"], tmp_path / "mixtral", smollm2_path)
    config = load_config(str(moe))
    counts = parameter_counts(config)
    out = freight("models", "check", str(moe)).stdout
    assert f"context      {config.max_position_embeddings:,} tokens" in out
    assert "model_type   mixtral" in out and "4 of 4 layers windowed (24 tokens)" in out
    assert "experts      8, top 2, on 4 layers" in out
    assert f"parameters   {counts.total:,} ({counts.active:,} active per token)" in out and counts.active < counts.total

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    refused = freight("models", "check", str(tmp_path / "gpt2"), check=False)
    assert refused.returncode == 2 and not refused.stdout
    assert "unsupported architecture 'gpt2'" in refused.stderr and "qwen3_moe, mixtral, phi3" in refused.stderr
