"""Refuse a request that is not a valid protobuf with INVALID_ARGUMENT (docs/design.md invariant 4).

grpcio answers a request it cannot parse with INTERNAL ("Exception deserializing
request!"), the same code as a server bug, and says nothing of what was wrong. The
:class:`MalformedRequests` server interceptor parses each request itself: bytes that
do not parse reach no handler and the caller gets INVALID_ARGUMENT naming the message
type and the parser's complaint. Works for unary requests and for request streams
(the stream is refused at the first malformed message; earlier ones were handled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

__all__ = ["MalformedRequests", "handler_parts"]


def handler_parts(handler: grpc.RpcMethodHandler) -> tuple[Callable, Callable]:
    """A handler's behaviour, and the factory of a handler of its kind (unary, streams)."""
    if handler.request_streaming and handler.response_streaming:
        return handler.stream_stream, grpc.stream_stream_rpc_method_handler
    if handler.request_streaming:
        return handler.stream_unary, grpc.stream_unary_rpc_method_handler
    if handler.response_streaming:
        return handler.unary_stream, grpc.unary_stream_rpc_method_handler
    return handler.unary_unary, grpc.unary_unary_rpc_method_handler


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, invalid UTF-8, ...: never the server's fault
            return _Malformed(f"{type(exc).__name__}: {str(exc)[:200]}")

    return parse


class MalformedRequests(grpc.ServerInterceptor):
    """Put last in ``grpc.server(interceptors=...)``: after authentication, before handlers."""

    def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        owner = getattr(handler.request_deserializer, "__self__", None)
        descriptor = getattr(owner, "DESCRIPTOR", None)
        what = descriptor.full_name if descriptor is not None else handler_call_details.method

        def refuse(request: _Malformed, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {what}: {request.why}")

        inner, make = handler_parts(handler)
        if handler.request_streaming:
            # Declared once: the two branches define it with different parameter names.
            behaviour: Callable[[Any, grpc.ServicerContext], Any]

            def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                for request in requests:
                    if isinstance(request, _Malformed):
                        refuse(request, context)  # raises
                    yield request

            def behaviour(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                return inner(checked(requests, context), context)

        else:

            def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    refuse(request, context)  # raises
                return inner(request, context)

        return make(
            behaviour,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
