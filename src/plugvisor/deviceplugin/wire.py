"""Requests that are not valid protobuf, answered INVALID_ARGUMENT rather than grpc's UNKNOWN.

grpc aio turns an exception raised by a request deserializer into UNKNOWN
("Unexpected DecodeError"), and nothing in between lets a server choose the
code. So the deserializer returns a :class:`MalformedRequest` instead of
raising, and the handler answers it with one clear line naming the method and
the message type (one ``is`` test per call). Shared by every servicer plugvisor
serves to the kubelet: the device plugin's and the DRA driver's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from plugvisor.common.validation import shorten

Context = grpc.aio.ServicerContext[Any, Any]


class MalformedRequest:
    """What a request that is not valid protobuf deserializes to: the handler answers INVALID_ARGUMENT."""

    __slots__ = ("error", "message_type")

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error

    def detail(self, method: str) -> str:
        """The status detail: the method, the message type expected, and why parsing failed."""
        return f"{method}: the request is not a valid {self.message_type} message ({shorten(self.error)})"


def tolerant_deserializer(message: type[Any]) -> Callable[[bytes], Any]:
    """``message.FromString`` that returns a :class:`MalformedRequest` instead of raising."""
    parse = message.FromString
    name = message.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return MalformedRequest(name, str(exc))

    return deserialize


def checked_unary(
    method: str,
    behaviour: Callable[[Any, Context], Awaitable[Any]],
    *,
    on_malformed: Callable[[], None] | None = None,
) -> Callable[[Any, Context], Awaitable[Any]]:
    """``behaviour``; a :class:`MalformedRequest` gets INVALID_ARGUMENT (``on_malformed`` counts it)."""

    async def handle(request: Any, context: Context) -> Any:
        if type(request) is MalformedRequest:
            if on_malformed is not None:
                on_malformed()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail(method))
        return await behaviour(request, context)

    return handle


def checked_stream(
    method: str,
    behaviour: Callable[[Any, Context], AsyncIterator[Any]],
    *,
    on_malformed: Callable[[], None] | None = None,
) -> Callable[[Any, Context], AsyncIterator[Any]]:
    """The streaming form of :func:`checked_unary`."""

    async def handle(request: Any, context: Context) -> AsyncIterator[Any]:
        if type(request) is MalformedRequest:
            if on_malformed is not None:
                on_malformed()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail(method))
        async for item in behaviour(request, context):
            yield item

    return handle
