"""What every /v1 route depends on: the caller's tenant (from `Authorization: Bearer <key>`) and the
job service. Shared by the native routes (app.py) and the OpenAI-compatible ones (openai_batch.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from jobs.domain.service import JobService
from storage.keys import tenant_for_key

bearer = HTTPBearer(auto_error=False, description="an API key from `freight keys create --tenant NAME`")


def _service(request: Request) -> JobService:
    return request.app.state.service


def _tenant(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str:
    unauthorized = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise HTTPException(401, "missing API key: send Authorization: Bearer <key>", headers=unauthorized)
    with _service(request).sessions() as session:
        tenant = tenant_for_key(session, credentials.credentials)
    if tenant is None:
        raise HTTPException(401, "invalid or revoked API key", headers=unauthorized)
    return tenant


Tenant = Annotated[str, Depends(_tenant)]
Service = Annotated[JobService, Depends(_service)]
