"""A local S3 for tests: moto's server on a free port of 127.0.0.1, and a fresh bucket."""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest


class S3(NamedTuple):
    options: dict  # s3fs storage options for the server
    bucket: str  # empty, this test's alone
    endpoint: str  # http://127.0.0.1:<port>


@contextlib.contextmanager
def moto_s3(monkeypatch: pytest.MonkeyPatch, prefix: str = "test") -> Iterator[S3]:
    """Skips the test where moto or s3fs is missing. Credentials are fake ones in the
    environment, never the machine's real ones."""
    server_module = pytest.importorskip(
        "moto.server", reason='S3 test needs moto and s3fs: pip install "moto[server]" s3fs'
    )
    pytest.importorskip("s3fs", reason='S3 test needs s3fs: pip install "moto[server]" s3fs')
    import fsspec

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as probe:  # a free port, released for the server to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {
        "key": "testing",
        "secret": "testing",
        # No region_name: s3fs would send it as a LocationConstraint, which moto refuses
        # for us-east-1 (AWS_DEFAULT_REGION above picks the region).
        "client_kwargs": {"endpoint_url": endpoint},
        "skip_instance_cache": True,
        "default_block_size": 5 << 20,  # S3's smallest part: a 12 MiB record is multipart
    }
    # moto keeps its buckets in process-wide state, across servers: one bucket per test.
    bucket = f"{prefix}-{uuid.uuid4().hex}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    try:
        yield S3(options, bucket, endpoint)
    finally:
        server.stop()
