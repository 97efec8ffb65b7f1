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
