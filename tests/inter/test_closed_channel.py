"""A call on a closed channel fails with CANCELLED instead of crashing the process.

gRPC Python segfaults when a method is registered on a closed channel, and a channel
with the job token's interceptor registers one on every call: CI lost a rank and an
`isthmus local` launcher that way (2026-12-02). Each case runs in a child process, so a
regression shows as that child's SIGSEGV, not as the test run's own death.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
    import threading
    from concurrent import futures

    import grpc

    from isthmus.inter.closable import ClosedChannelError
    from isthmus.inter.security import SiteSecurity
    from isthmus.proto import coordinator_pb2 as pb
    from isthmus.proto import coordinator_pb2_grpc as pb_grpc

    # The servicer's base class answers UNIMPLEMENTED: a call that reached the server.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_CoordinatorServicer_to_server(pb_grpc.CoordinatorServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    security = SiteSecurity(token="t" * 32)
    ASK = pb.GetMembershipRequest()


    def call(stub, method="GetMembership", request=ASK):
        try:
            getattr(stub, method)(request, timeout=10)
        except grpc.RpcError as exc:
            return exc
        raise AssertionError("the servicer's base class answered")
"""

AFTER_CLOSE = """
    with security.channel(f"127.0.0.1:{port}") as channel:  # closed at the block's end
        stub = pb_grpc.CoordinatorStub(channel)
        assert call(stub).code() is grpc.StatusCode.UNIMPLEMENTED
    # A method first called after the close: gRPC registers it then (the crash).
    exc = call(stub, "CommitStep", pb.CommitStepRequest())
    assert isinstance(exc, ClosedChannelError), exc
    exc = call(stub)  # one called before
    assert isinstance(exc, ClosedChannelError), exc
    assert exc.code() is grpc.StatusCode.CANCELLED and exc.details(), exc
    try:  # a stub made after the close, and a stream on it
        stream = pb_grpc.CoordinatorStub(channel).HostSession(iter(()), timeout=10)
        list(stream)
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.CANCELLED, exc
    else:
        raise AssertionError("a stream opened on a closed channel")
    print("ok")
"""

RACING_CLOSE = """
    codes = set()
    for _ in range(50):
        channel = security.channel(f"127.0.0.1:{port}")
        stub = pb_grpc.CoordinatorStub(channel)
        call(stub)
        started = threading.Barrier(5)

        def call_until_closed():
            started.wait()
            while True:
                exc = call(stub)
                codes.add(exc.code())
                if isinstance(exc, ClosedChannelError):
                    return

        threads = [threading.Thread(target=call_until_closed) for _ in range(4)]
        for thread in threads:
            thread.start()
        started.wait()
        channel.close()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()
    assert grpc.StatusCode.CANCELLED in codes, codes
    print("ok")
"""


@pytest.mark.parametrize("case", ["after_close", "racing_close"])
def test_a_call_on_a_closed_token_channel_is_cancelled_not_a_crash(case):
    body = AFTER_CLOSE if case == "after_close" else RACING_CLOSE
    source = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", source],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        done.returncode,
        done.stderr[-3000:],
    )
