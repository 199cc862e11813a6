"""A real S3 HTTP endpoint (moto's server) on loopback, with one bucket: for tests and benches.

Imported by name from tests (tests/conftest.py's ``s3`` fixture) and loaded by path from bench/.
"""

from __future__ import annotations

import socket


def start_s3(bucket: str) -> tuple[object, dict]:
    """(the running server: call ``.stop()``, {"url", "endpoint", "storage_options"})."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    storage_options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=bucket)
    return server, {"url": f"s3://{bucket}", "endpoint": endpoint, "storage_options": storage_options}
