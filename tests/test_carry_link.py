"""A thin island and its carrier over real sockets (federation/carry_link.py): the weights go
down and a row goes up signed and checked; an outsider, a replayed request, an oversized
or dripping upload and a carrier of another model are refused without harm to the next
honest call."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarrierBook, CarryRefused, pack_request
from archipelago.federation.carry_link import ROW_PATH, WEIGHTS_PATH, CarryClient, CarryServer, row_frame_bytes
from archipelago.federation.codecs import build_codec
from archipelago.federation.http_serving import FRAME_HEADER
from archipelago.federation.policy import Allowance
from archipelago.federation.trust import FederationKey

NUMEL = 1000
CARRIER, THIN = 0, 2
ALLOW = Allowance(max_tokens=4096, max_norm=1e3)

pytestmark = pytest.mark.timeout(60)


def _codec():  # noqa: ANN202 - a Codec
    return build_codec(FaultToleranceConfig(codec="int8"), NUMEL)


@pytest.fixture
def carrier(monkeypatch):  # noqa: ANN201 - (key, server)
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    key = FederationKey(os.urandom(32))
    server = CarryServer(CarrierBook(key, CARRIER, {THIN}), _codec(), ALLOW, request_timeout=1.0)
    yield key, server
    server.close()


def _client(key: FederationKey, server: CarryServer, numel: int = NUMEL) -> CarryClient:
    return CarryClient(key, THIN, CARRIER, server.address(), numel, timeout=10)


def _raw(server: CarryServer, data: bytes, wait: float = 5.0) -> bytes:
    """Send `data` on a fresh connection and read the answer until the server closes."""
    host, port = server._server.server_address[:2]
    with socket.create_connection((host, port), timeout=wait) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_weights_go_down_and_one_row_per_download_comes_up(carrier):
    key, server = carrier
    client = _client(key, server)
    with pytest.raises(ConnectionError, match="no global weights yet"):
        client.download()
    weights = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    server.publish(7, weights)
    got = client.download()
    assert got.step == 7 and torch.equal(got.weights, weights.bfloat16().float())
    row = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)) * 1e-2
    client.upload(got, 640, _codec(), row)
    (upload,) = server.take_uploads()
    assert (upload.island, upload.base_step, upload.tokens) == (THIN, 7, 640.0)
    assert torch.equal(upload.values, _codec().decode(_codec().encode(row)))
    assert server.take_uploads() == []
    with pytest.raises(CarryRefused, match="names no download"):  # the same download's row again
        client.upload(got, 640, _codec(), row)
    # A later download is served at the step published then.
    server.publish(8, weights + 1)
    assert client.download().step == 8


def test_an_outsider_gets_nothing_and_a_recorded_request_fetches_nothing(carrier):
    key, server = carrier
    server.publish(1, torch.zeros(NUMEL))
    outsider = CarryClient(FederationKey(os.urandom(32)), THIN, CARRIER, server.address(), NUMEL, timeout=10)
    with pytest.raises(CarryRefused, match="refused this island's download"):
        outsider.download()
    request = f"GET {WEIGHTS_PATH} HTTP/1.0\r\n{FRAME_HEADER}: {pack_request(key, THIN, 99).hex()}\r\n\r\n".encode()
    assert _raw(server, request).startswith(b"HTTP/1.0 200")
    replayed = _raw(server, request)
    assert replayed.startswith(b"HTTP/1.0 403") and b"answered before" in replayed
    assert _raw(server, f"GET {WEIGHTS_PATH} HTTP/1.0\r\n{FRAME_HEADER}: zz\r\n\r\n".encode()).startswith(
        b"HTTP/1.0 403")
    assert _raw(server, b"GET /checkpoint/1/full HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 404")
    assert server.take_uploads() == []


def test_an_oversized_or_dripping_upload_is_refused_and_the_next_one_served(carrier):
    key, server = carrier
    server.publish(1, torch.zeros(NUMEL))
    client = _client(key, server)
    client.download()  # uploads are read only from an address served a download (test_slow_senders.py)
    cap = row_frame_bytes(_codec())
    began = time.monotonic()
    answer = _raw(server, f"PUT {ROW_PATH} HTTP/1.0\r\nContent-Length: {cap + 1}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.0 413") and time.monotonic() - began < 0.9  # before any body
    assert _raw(server, f"PUT {ROW_PATH} HTTP/1.0\r\n\r\n".encode()).startswith(b"HTTP/1.0 411")
    # A declared length within the cap, a few bytes, then nothing: closed at the deadline
    # (request_timeout, 1 s here), unanswered.
    began = time.monotonic()
    assert _raw(server, f"PUT {ROW_PATH} HTTP/1.0\r\nContent-Length: {cap}\r\n\r\nabc".encode()) == b""
    assert 0.9 < time.monotonic() - began < 4
    # the honest thin island is served as before
    client.upload(client.download(), 10, _codec(), torch.zeros(NUMEL))
    assert len(server.take_uploads()) == 1
    # Bytes that are not a frame, within the cap: refused by the book, nothing staged.
    junk = os.urandom(cap)
    refused = _raw(server, f"PUT {ROW_PATH} HTTP/1.0\r\nContent-Length: {cap}\r\n\r\n".encode() + junk)
    assert refused.startswith(b"HTTP/1.0 403") and server.take_uploads() == []


def test_a_thin_island_refuses_a_carrier_of_another_model_and_names_an_unreachable_one(carrier):
    key, server = carrier
    server.publish(1, torch.zeros(NUMEL))
    with pytest.raises(CarryRefused, match="not a carrier of this federation's model"):
        _client(key, server, numel=NUMEL - 10).download()
    host, port = server._server.server_address[:2]
    server.close()
    with pytest.raises(ConnectionError, match="fault_tolerance.carrier"):
        _client(key, server).download()
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        CarryClient(key, THIN, CARRIER, f"file://{host}:{port}/x", NUMEL)


def test_a_thin_link_may_send_sparser_rows_and_a_codec_mismatch_is_named(monkeypatch):
    from archipelago.federation.carrying import carry_codec

    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    key = FederationKey(os.urandom(32))
    sparse = FaultToleranceConfig(codec="int8", carry_codec="topk", topk_fraction=0.05)
    server = CarryServer(CarrierBook(key, CARRIER, {THIN}), carry_codec(sparse, NUMEL), ALLOW, request_timeout=1.0)
    try:
        server.publish(1, torch.zeros(NUMEL))
        client = _client(key, server)
        row = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3)) * 1e-2
        thin_codec = carry_codec(sparse, NUMEL)
        assert thin_codec.payload_bytes() < _codec().payload_bytes() / 4  # far fewer bytes than int8
        client.upload(client.download(), 10, thin_codec, row)
        (upload,) = server.take_uploads()
        reference = carry_codec(sparse, NUMEL)  # a fresh encoder: no residue yet, as the thin island's first row
        assert torch.equal(upload.values, reference.decode(reference.encode(row)))
        assert int((upload.values != 0).sum()) <= 13 * 4  # 5% of each 256-value chunk, rounded up
        with pytest.raises(CarryRefused, match="carry_codec"):  # a thin island that sends int8 rows to it
            client.upload(client.download(), 10, _codec(), row)
    finally:
        server.close()
