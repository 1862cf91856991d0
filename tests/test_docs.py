"""The docs stay true to the code: the generated configuration page, the README's size and links.

`mkdocs build --strict` (run by scripts/test.sh) checks the links inside docs/; these tests check what it
cannot see: the configuration page against the settings object, and the README, which is not in the site.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_generated_from_the_settings():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == _generator().render(), (
        "docs/configuration.md is stale: run .venv/bin/python scripts/gen_config_docs.py"
    )


def test_every_setting_is_on_the_configuration_page():
    from jobs.domain.settings import Settings

    page = (ROOT / "docs" / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`FREIGHT_{name.upper()}`" in page


def test_the_readme_is_short_and_keeps_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    # .ci/run and scripts/test.sh call this "the README's test command"
    assert "bash scripts/test.sh" in readme


def test_the_readmes_links_point_at_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+://|#|mailto:", t)]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_every_docs_page_is_in_the_site_navigation():
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    nav = "\n".join(line for line in lines if not line.strip().startswith("#"))
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if p not in nav] == []
