"""Object-store settings that no retry can fix are reported at once, saying what to set:
a plain-http endpoint without ``AWS_ALLOW_HTTP=true``, an endpoint that cannot be reached,
a bucket that does not exist (on reading and on writing, against moto on loopback)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from dcp_reader import MissingFileError, NativeWriter, StorageConfigError, open_checkpoint
from dcp_reader.storage import _settings

pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def moto_endpoint():
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(monkeypatch, moto_endpoint):
    for k, v in {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_REGION": "us-east-1",
                 "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true",
                 "DCP_STORAGE_TOTAL_TIMEOUT": "20"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return moto_endpoint


def test_a_plain_http_endpoint_without_allow_http_is_refused_at_once(s3, monkeypatch):
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    t0 = time.monotonic()
    with pytest.raises(StorageConfigError) as e:
        open_checkpoint("s3://ckpts/x")
    assert time.monotonic() - t0 < 5  # was: retried until DCP_STORAGE_TOTAL_TIMEOUT, "overloaded"
    assert "AWS_ALLOW_HTTP=true" in str(e.value) and s3 in str(e.value)
    assert "overloaded" not in str(e.value)


def test_an_endpoint_that_cannot_be_reached_is_named_at_once(s3, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(StorageConfigError, match=rf"cannot reach the object store at http://127.0.0.1:{port} "
                                                 r"\(AWS_ENDPOINT_URL\)"):
        open_checkpoint("s3://ckpts/x")
    assert time.monotonic() - t0 < 5


def test_without_an_endpoint_the_message_says_where_requests_went(s3, monkeypatch):
    """AWS_ENDPOINT_URL unset and no network: one bounded connection, then an error naming
    AWS's endpoint and the variable to set (was: over 60 s with nothing printed)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    seen = []

    def no_network(address, timeout=None, *args, **kw):
        seen.append((address, timeout))
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(_settings.socket, "create_connection", no_network)
    monkeypatch.setattr(_settings, "_REACHED", set())
    with pytest.raises(StorageConfigError) as e:
        open_checkpoint("s3://ckpts/x")
    assert seen == [(("s3.eu-west-3.amazonaws.com", 443), 10.0)]
    text = str(e.value)
    assert "https://s3.eu-west-3.amazonaws.com" in text and "AWS_ENDPOINT_URL is unset" in text
    assert "set AWS_ENDPOINT_URL" in text


def test_inspecting_a_missing_bucket_says_to_create_it(s3):
    with pytest.raises(MissingFileError) as e:
        open_checkpoint("s3://nobucket/x")
    text = str(e.value)
    assert "(for None)" not in text and "copy the missing object" not in text
    assert f"bucket 'nobucket' does not exist at {s3}" in text and "create it" in text


def test_saving_into_a_missing_bucket_says_to_create_it(s3):
    w = NativeWriter("s3://nosuchbucket/ck")
    with pytest.raises(MissingFileError) as e:
        w.write_file("rank-00000.safetensors", {"w": np.zeros(4, np.float32)})
    text = str(e.value)
    assert "(for None)" not in text and "the checkpoint is incomplete" not in text
    assert f"bucket 'nosuchbucket' does not exist at {s3}" in text and "create it" in text
