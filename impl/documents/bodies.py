"""The document API's HTTP bodies, headers and path parameters: pydantic at the boundary
(:mod:`.server` declares the routes with them; the OpenAPI document is generated from them)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from fastapi import Header, Path
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from knownstate.model.document import (
    ID_PATTERN,
    MAX_KEYS,
    MAX_VERSION,
    USER_PATTERN,
    WRITER_PATTERN,
)

Version = Annotated[int, Field(strict=True, ge=1, le=MAX_VERSION)]
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Scalar = Union[StrictBool, StrictInt, FiniteFloat, StrictStr]
ContentBody = Annotated[dict[str, Scalar], Field(max_length=MAX_KEYS)]


class SaveBody(BaseModel):
    """A save: the full content, the version it was based on, and the save's identity."""

    model_config = ConfigDict(extra="forbid")
    expectedVersion: Version | None = None
    content: ContentBody
    writerId: Annotated[str, Field(pattern=WRITER_PATTERN)]
    saveSeq: Version


class CreateBody(BaseModel):
    """A new document: a copy of one the user may read (``copyOf``), or a kind and schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    content: ContentBody
    writerId: Annotated[str, Field(pattern=WRITER_PATTERN)]
    saveSeq: Version
    copyOf: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    kind: Literal["record", "sheet"] | None = None
    schema_: dict | None = Field(default=None, alias="schema")


class ShareBody(BaseModel):
    """What a user may do with a shared document: read it, and write it when ``canWrite``."""

    model_config = ConfigDict(extra="forbid")
    canWrite: StrictBool


class SharedOut(BaseModel):
    id: str
    user: str
    canWrite: bool


class RevokedOut(BaseModel):
    id: str
    user: str
    revoked: bool


class AccessOut(BaseModel):
    id: str
    owner: str
    access: dict[str, bool]


class DocumentOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    id: str
    kind: str
    schema_: dict = Field(alias="schema")
    version: int
    content: dict


class SavedOut(BaseModel):
    id: str
    version: int
    replayed: bool


class ErrorOut(BaseModel):
    error: str
    message: str


class ConflictOut(ErrorOut):
    version: int
    content: dict


UserHeader = Annotated[
    str | None,
    Header(
        alias="X-User",
        description="The user making the request: a stand-in for authentication (see the README).",
    ),
]
IfMatchHeader = Annotated[
    str | None, Header(alias="If-Match", description='The base version as its ETag, "3".')
]
IdPath = Annotated[str, Path(pattern=ID_PATTERN)]
UserPath = Annotated[str, Path(pattern=USER_PATTERN)]
