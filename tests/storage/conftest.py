from tests.jobs.service_fixtures import pg_url  # noqa: F401 - fixture
