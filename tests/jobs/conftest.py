from tests.jobs.service_fixtures import (  # noqa: F401 - fixtures
    api_keys,
    api_url,
    client,
    log_dir,
    pg_url,
    queue_prefix,
    redis_url,
    service_env,
    worker,
)
