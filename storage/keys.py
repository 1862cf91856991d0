"""API keys: `frk_<key_id>_<secret>`; only a salted hash of the secret is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from storage.models import ApiKey, utcnow

KEY_PREFIX = "frk"
_UNKNOWN_SALT = "0" * 32
_UNKNOWN_HASH = "0" * 64  # no secret hashes to this


@dataclass(frozen=True)
class NewKey:
    key_id: str
    tenant: str
    key: str  # shown once; never stored


def _hash_secret(salt: str, secret: str) -> str:
    return hashlib.sha256(f"{salt}:{secret}".encode()).hexdigest()


def create_key(session: Session, tenant: str) -> NewKey:
    if not tenant.strip():
        raise ValueError("tenant must not be empty")
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    session.add(ApiKey(key_id=key_id, tenant=tenant, salt=salt, secret_hash=_hash_secret(salt, secret)))
    session.commit()
    return NewKey(key_id=key_id, tenant=tenant, key=f"{KEY_PREFIX}_{key_id}_{secret}")


def _split(key: str) -> tuple[str, str] | None:
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def tenant_for_key(session: Session, key: str) -> str | None:
    """The tenant a valid, unrevoked key belongs to; None otherwise."""
    parts = _split(key)
    if parts is None:
        return None
    key_id, secret = parts
    row = session.get(ApiKey, key_id)
    # Hash and compare even for an unknown key id, so the answer takes the same time either way.
    salt, stored = (row.salt, row.secret_hash) if row is not None else (_UNKNOWN_SALT, _UNKNOWN_HASH)
    matches = hmac.compare_digest(stored, _hash_secret(salt, secret))
    if row is None or row.revoked_at is not None or not matches:
        return None
    return row.tenant


def revoke_key(session: Session, key_or_key_id: str) -> bool:
    parts = _split(key_or_key_id)
    key_id = parts[0] if parts else key_or_key_id
    result = session.execute(
        update(ApiKey).where(ApiKey.key_id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow())
    )
    session.commit()
    return result.rowcount == 1


def list_keys(session: Session, tenant: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    return list(session.scalars(query))
