"""Pre-signed GET URLs of job files in an S3 store, so a tenant can fetch its results straight from the
bucket instead of through the API.

pyarrow's S3 layer (what every other job-file access uses, storage/blobs.py) has no presigner, and
Freight signs nothing by hand: the URL is made by `obstore.sign`, the Python binding of the Rust
`object_store` crate's SigV4 signer. Signing is local (no request is sent) and uses the same settings as
the store: FREIGHT_S3_ENDPOINT_URL and the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN /
AWS_REGION variables (obstore reads them; it does not read ~/.aws profiles)."""

from __future__ import annotations

import os
from datetime import timedelta

from storage.blobs import BlobStore

# SigV4 query signatures are valid for at most seven days (AWS refuses longer ones).
MAX_EXPIRY = timedelta(days=7)


class NotSignable(RuntimeError):
    """The store has no pre-signed URLs: its job files are in a local folder."""


def presigned_get_url(store: BlobStore, name: str, expires_in: timedelta, endpoint_url: str | None) -> str:
    """A URL that GETs the job file `name` without credentials until `expires_in` from now."""
    if store.is_local:
        raise NotSignable(f"job files are in a local folder ({store.url}): there is no URL to sign")
    if not timedelta(seconds=1) <= expires_in <= MAX_EXPIRY:
        raise ValueError(f"expires_in must be between 1 s and {MAX_EXPIRY.days} days")
    # Imported here: only the API's pre-signed URL route needs it, and no other process should pay for it.
    import obstore
    from obstore.store import S3Store

    bucket, _, key = store.key(name).partition("/")  # key() checked the name (server-made, no "..")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    options = {}
    if endpoint_url is not None:
        # The same path-style addressing as the store (storage_url.s3_filesystem): http(s)://host/bucket/key
        options = {"endpoint": endpoint_url.rstrip("/"), "virtual_hosted_style_request": False}
    client = {"allow_http": True} if (endpoint_url or "").startswith("http://") else None
    signer = S3Store(bucket, region=region, client_options=client, **options)
    return obstore.sign(signer, "GET", key, expires_in)
