"""API keys: shown once, stored as a salted hash, bound to a tenant, revocable."""

from __future__ import annotations

from sqlalchemy import select

from storage.db import make_engine, make_session_factory
from storage.keys import create_key, list_keys, revoke_key, tenant_for_key
from storage.models import ApiKey


def test_keys_resolve_to_their_tenant_and_revoke(pg_url: str) -> None:
    engine = make_engine(pg_url)
    sessions = make_session_factory(engine)
    with sessions() as session:
        first = create_key(session, "tenant-a")
        second = create_key(session, "tenant-b")
        assert tenant_for_key(session, first.key) == "tenant-a"
        assert tenant_for_key(session, second.key) == "tenant-b"
        stored = session.scalars(select(ApiKey).where(ApiKey.key_id == first.key_id)).one()
        secret = first.key.split("_", 2)[2]
        assert secret not in stored.secret_hash and first.key not in stored.secret_hash
        assert len(stored.salt) == 32 and stored.salt != session.get(ApiKey, second.key_id).salt

        # A wrong secret with a real key id, a malformed key, an unknown id: all refused.
        assert tenant_for_key(session, first.key[:-1] + ("A" if first.key[-1] != "A" else "B")) is None
        assert tenant_for_key(session, "not-a-key") is None
        assert tenant_for_key(session, f"frk_{'0' * 16}_{secret}") is None

        assert revoke_key(session, first.key_id)
        assert not revoke_key(session, first.key_id)  # already revoked
        assert tenant_for_key(session, first.key) is None
        assert revoke_key(session, second.key)  # the whole key works too
        assert {k.key_id for k in list_keys(session, "tenant-a")} == {first.key_id}
    engine.dispose()
