"""Images from what a client sends: ``data:`` URLs (base64 PNG / JPEG / WebP / GIF...), ``file://`` paths under an
allowed folder, and (off by default) ``http(s)`` URLs; Pillow decodes them.

Every failure is an :class:`~tokenmill.errors.InvalidRequestError` naming the request field (``param``), so the
server answers 400 and keeps serving.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError

# Decoded images larger than this many pixels are refused (Pillow's own bomb check is a warning up to 2x this).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


@dataclass(frozen=True)
class MediaConnector:
    """Where images may come from.

    Attributes:
        allowed_local_media_path: ``file://`` URLs must point inside this folder (``None``: refused), as vLLM's
            ``--allowed-local-media-path``.
        allow_http: fetch ``http(s)`` URLs (off by default: the engine reaches no network unless asked).
        http_timeout_s: the fetch's time limit (seconds).
        max_bytes: the most bytes an image's encoded form may have (data URL, file or download).
    """

    allowed_local_media_path: str | None = None
    allow_http: bool = False
    http_timeout_s: float = 10.0
    max_bytes: int = 32 * 1024 * 1024

    def load_image(self, url: str, param: str) -> Any:
        """The RGB ``PIL.Image.Image`` that ``url`` holds.

        Raises:
            InvalidRequestError: an unsupported or refused URL scheme, a path outside the allowed folder, bad
                base64, bytes Pillow cannot decode, or an image over the size limits (``param`` is ``param``).
        """
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{param}: the image URL must be a non-empty string", param=param)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            raw = self._data_url_bytes(url, param)
        elif scheme == "file":
            raw = self._file_bytes(url, param)
        elif scheme in ("http", "https"):
            raw = self._http_bytes(url, param)
        else:
            raise InvalidRequestError(
                f"{param}: unsupported image URL scheme {scheme or '(none)'!r}; use a data: URL (base64), a file:// "
                "URL under --allowed-local-media-path, or http(s) with --allow-image-http", param=param)
        return decode_image(raw, param)

    def _data_url_bytes(self, url: str, param: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise InvalidRequestError(f"{param}: a data: URL needs a ',' before its payload", param=param)
        media_type = header.split(";", 1)[0].strip().lower()
        if media_type and not media_type.startswith("image/"):
            raise InvalidRequestError(f"{param}: the data URL holds {media_type!r}, not an image", param=param)
        if ";base64" not in header.lower():
            raise InvalidRequestError(f"{param}: only base64 data URLs are supported (data:image/png;base64,...)",
                                      param=param)
        if len(payload) > self.max_bytes * 4 // 3 + 4:
            raise InvalidRequestError(f"{param}: the image is larger than {self.max_bytes} bytes", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(f"{param}: the data URL's base64 payload is invalid ({exc})",
                                      param=param) from exc

    def _file_bytes(self, url: str, param: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise InvalidRequestError(f"{param}: file:// image URLs are refused (start the server with "
                                      "--allowed-local-media-path DIR to allow a folder)", param=param)
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidRequestError(f"{param}: file:// URLs must name a local path", param=param)
        path = os.path.realpath(urllib.parse.unquote(parsed.path))
        root = os.path.realpath(self.allowed_local_media_path)
        if os.path.commonpath([path, root]) != root:
            raise InvalidRequestError(f"{param}: {path!r} is outside the allowed local media path", param=param)
        try:
            if os.path.getsize(path) > self.max_bytes:
                raise InvalidRequestError(f"{param}: the image is larger than {self.max_bytes} bytes", param=param)
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise InvalidRequestError(f"{param}: cannot read {path!r}: {exc.strerror}", param=param) from exc

    def _http_bytes(self, url: str, param: str) -> bytes:
        if not self.allow_http:
            raise InvalidRequestError(f"{param}: fetching images over http(s) is off on this server; send the image "
                                      "as a base64 data: URL (or start the server with --allow-image-http)",
                                      param=param)
        import urllib.request

        try:
            with urllib.request.urlopen(url, timeout=self.http_timeout_s) as response:  # noqa: S310 - scheme checked
                raw = response.read(self.max_bytes + 1)
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"{param}: could not fetch the image: {exc}", param=param) from exc
        if len(raw) > self.max_bytes:
            raise InvalidRequestError(f"{param}: the image is larger than {self.max_bytes} bytes", param=param)
        return raw


def decode_image(raw: bytes, param: str) -> Any:
    """Decode encoded image bytes into an RGB ``PIL.Image.Image`` (loaded, so errors surface here).

    Raises:
        InvalidRequestError: Pillow cannot identify or decode the bytes, or the image is too large.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(f"{param}: the image has {image.width}x{image.height} pixels, more than "
                                          f"{MAX_IMAGE_PIXELS}", param=param)
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"{param}: the image could not be decoded ({exc})", param=param) from exc
