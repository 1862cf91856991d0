"""Strict multipart/form-data, one parser for every upload route (`POST /v1/jobs`, `POST /v1/files`).

FastAPI's File()/Form() take the last of repeated parts and accept a body cut short before its closing
boundary (python-multipart does not check; the last part is silently dropped). Here a form is refused
with a 4xx that names the part when it is cut short, repeats a part, has a part the route does not
take, sends a file where a field belongs (or the reverse), or lacks a required part. A preamble before
the first boundary is allowed (RFC 2046), and so is an epilogue after the last. Field values follow the
text rule (jobs/domain/text_rule.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from python_multipart.multipart import DEFAULT_MAX_HEADER_SIZE
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser, parse_options_header

from jobs.domain.errors import InputError, clip, clip_repr
from jobs.domain.text_rule import text_problem

MAX_FIELD_BYTES = 1024 * 1024
MAX_PREAMBLE_BYTES = 64 * 1024
# python-multipart's limit of one header line of a part: a 100 KB part name is refused, and said so.
MAX_PART_HEADER_BYTES = DEFAULT_MAX_HEADER_SIZE


@dataclass(frozen=True)
class FormSpec:
    """The parts a route takes: `files` are file parts (with a filename), `fields` plain fields."""

    files: tuple[str, ...]
    fields: tuple[str, ...]
    required: tuple[str, ...]
    what: str  # "the job", "the file": for messages

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.files, *self.fields)

    def describe(self) -> str:
        return " and ".join(f"`{name}`" for name in self.names)


class _CheckedMultiPartParser(MultiPartParser):
    """Starlette's parser, which also notes whether the closing boundary came, bounds part headers, and
    refuses (rather than reads as Latin-1, as Starlette does) names and fields that are not UTF-8."""

    ended = False

    def on_end(self) -> None:
        self.ended = True

    def on_headers_finished(self) -> None:
        _disposition, options = parse_options_header(self._current_part.content_disposition)
        for key in (b"name", b"filename"):
            if key in options:
                _utf8(options[key], f"the part's {key.decode()}", "body")
        super().on_headers_finished()

    def on_part_end(self) -> None:
        if self._current_part.file is None:
            name = clip(self._current_part.field_name, 64)
            _utf8(bytes(self._current_part.data), f"`{name}`", name)
        super().on_part_end()


def _reason(exc: MultiPartException) -> str:
    """What python-multipart found (Starlette says only "Invalid multipart data")."""
    cause = str(exc.__cause__) if exc.__cause__ is not None else ""
    if "header size" in cause:
        return (
            f"a part's header is longer than {MAX_PART_HEADER_BYTES} bytes (a part name or file name that "
            "long is refused)"
        )
    return clip(cause or exc.message)


def _utf8(raw: bytes, what: str, field: str) -> str:
    """The text rule for bytes of the body (`what` names them in the message, `field` is the param)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not valid UTF-8 text (byte {exc.start})", field=field) from exc
    problem = text_problem(text)
    if problem is not None:
        raise InputError(f"{what} {problem}", field=field)
    return text


async def read_form(request: Request, spec: FormSpec) -> FormData:
    """The checked form; the caller closes it (`form_dependency` does, after the route)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        async for _chunk in request.stream():  # read the body so the connection stays usable
            pass
        raise InputError(
            f"send {spec.what} as multipart/form-data with the parts {spec.describe()}",
            status_code=415 if content_type else 422,
            field=spec.names[0],
        )
    parser = _CheckedMultiPartParser(
        request.headers,
        _without_preamble(request.stream(), _boundary(content_type)),
        max_files=len(spec.names) + 1,
        max_fields=len(spec.names) + 1,
        max_part_size=MAX_FIELD_BYTES,
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        if exc.message.startswith("Part exceeded maximum size"):  # Starlette's max_part_size, fields only
            name = clip(parser._current_part.field_name or "?", 64)
            raise InputError(
                f"the `{name}` field is larger than {MAX_FIELD_BYTES} bytes, the limit of a form field",
                status_code=413,
                field=name,
            ) from exc
        raise InputError(f"malformed multipart body: {_reason(exc)}", status_code=400) from exc
    except InputError:
        for spooled in getattr(parser, "_files_to_close_on_error", []):
            spooled.close()
        raise
    try:
        if not parser.ended:
            for spooled in getattr(parser, "_files_to_close_on_error", []):
                spooled.close()
            raise InputError(
                "the multipart body ends without its closing boundary: it is incomplete", status_code=400
            )
        check_parts(form, spec)
    except BaseException:
        await form.close()
        raise
    return form


def form_dependency(spec: FormSpec) -> Callable[[Request], AsyncIterator[FormData]]:
    """A FastAPI dependency giving the route the checked form, closed after the route."""

    async def dependency(request: Request) -> AsyncIterator[FormData]:
        form = await read_form(request, spec)
        try:
            yield form
        finally:
            await form.close()

    return dependency


def _boundary(content_type: str) -> bytes | None:
    _kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    return boundary if isinstance(boundary, bytes) and boundary else None


async def _without_preamble(stream: AsyncIterator[bytes], boundary: bytes | None) -> AsyncIterator[bytes]:
    """The body from its first boundary on: RFC 2046 allows text before it (a preamble), which
    python-multipart refuses. A body with no boundary in its first MAX_PREAMBLE_BYTES is malformed."""
    if boundary is None:  # the parser says so itself
        async for chunk in stream:
            yield chunk
        return
    delimiter = b"--" + boundary
    head = b""
    async for chunk in stream:
        head += chunk
        if head.startswith(delimiter):
            break
        found = head.find(b"\r\n" + delimiter)
        if found >= 0:
            head = head[found + 2 :]
            break
        if len(head) > MAX_PREAMBLE_BYTES:
            raise InputError(
                f"malformed multipart body: no boundary in its first {MAX_PREAMBLE_BYTES} bytes", status_code=400
            )
    yield head
    async for chunk in stream:
        yield chunk


def check_parts(form: FormData, spec: FormSpec) -> None:
    for name in dict.fromkeys(form.keys()):
        if name not in spec.names:
            raise InputError(
                f"unknown part {clip_repr(name)}; the body takes {spec.describe()}", field=clip(name, 64)
            )
        count = len(form.getlist(name))
        if count > 1:
            raise InputError(f"the body has {count} `{name}` parts; send one", field=name)
    for name in spec.required:
        if form.get(name) is None:
            raise InputError(f"the `{name}` part is missing", field=name)
    for name in spec.files:
        value = form.get(name)
        if isinstance(value, str):
            raise InputError(f"`{name}` must be a file part (with a filename), not a plain form field", field=name)
    for name in spec.fields:
        value = form.get(name)
        if value is not None and not isinstance(value, str):
            raise InputError(f"`{name}` must be a plain form field, not a file", field=name)
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                raise InputError(f"`{name}` {problem}", field=name)


def file_part(form: FormData, name: str) -> UploadFile:
    value = form.get(name)
    assert isinstance(value, UploadFile)  # check_parts made sure
    return value
