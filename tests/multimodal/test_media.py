"""Loading images from URLs: data URLs of each format, file:// only under the allowed folder, http(s) off by
default, and the 400s (``param`` named) for everything else."""

from __future__ import annotations

import pytest

from tests.models.vision_models import data_url, random_image
from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.inputs import TensorData
from tokenmill.multimodal.media import MediaConnector


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_data_urls_decode_to_rgb(fmt):
    image = MediaConnector().load_image(data_url(random_image(1, 9, 7), fmt), "p")
    assert image.mode == "RGB" and image.size == (9, 7)


def test_file_urls_only_inside_the_allowed_folder(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    random_image(2, 5, 5).save(inside / "a.png")
    random_image(3, 5, 5).save(tmp_path / "b.png")
    allowed = MediaConnector(allowed_local_media_path=str(inside))
    assert allowed.load_image(f"file://{inside}/a.png", "p").size == (5, 5)
    for url in (f"file://{tmp_path}/b.png", f"file://{inside}/../b.png", f"file://{inside}/missing.png"):
        with pytest.raises(InvalidRequestError) as err:
            allowed.load_image(url, "messages[0].content[1]")
        assert err.value.param == "messages[0].content[1]"
    with pytest.raises(InvalidRequestError, match="allowed-local-media-path"):
        MediaConnector().load_image(f"file://{inside}/a.png", "p")


@pytest.mark.parametrize(("url", "match"), [
    ("http://example.com/cat.png", "allow-image-http"),
    ("ftp://example.com/cat.png", "unsupported image URL scheme"),
    ("data:image/png;base64,###", "base64"),
    ("data:image/png,rawbytes", "only base64"),
    ("data:text/plain;base64,aGk=", "not an image"),
    ("data:image/png;base64,aGVsbG8=", "could not be decoded"),
    ("", "non-empty"),
])
def test_bad_urls_are_invalid_requests(url, match):
    with pytest.raises(InvalidRequestError, match=match) as err:
        MediaConnector().load_image(url, "img")
    assert err.value.param == "img"


def test_tensor_data_round_trip():
    import torch

    for t in (torch.randn(2, 3), torch.arange(6).reshape(3, 2), torch.randn(4).to(torch.bfloat16)):
        back = TensorData.from_tensor(t).to_tensor()
        assert back.dtype == t.dtype and torch.equal(back, t)


def test_http_fetch_when_allowed(tmp_path, monkeypatch):
    import functools
    import http.server
    import threading

    for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    random_image(6, 8, 6).save(tmp_path / "cat.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert MediaConnector(allow_http=True).load_image(f"{base}/cat.png", "p").size == (8, 6)
        with pytest.raises(InvalidRequestError, match="could not fetch"):
            MediaConnector(allow_http=True).load_image(f"{base}/missing.png", "p")
        with pytest.raises(InvalidRequestError, match="larger than"):
            MediaConnector(allow_http=True, max_bytes=10).load_image(f"{base}/cat.png", "p")
    finally:
        server.shutdown()
        server.server_close()
