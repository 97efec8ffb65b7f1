"""OpenAI chat content parts with images -> what a chat template renders, plus the images in order.

Parts: ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as a
string), the Responses API's ``{"type": "input_image", "image_url": ...}``, and offline ``{"type": "image_pil",
"image_pil": PIL image}``. A message with an image keeps its content as a list for the template, each image
as ``{"type": "image"}`` (what Hugging Face chat templates of vision-language models expect); a message with
text parts only becomes one string (parts joined by newlines), as text-only templates expect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.media import MediaConnector

IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil")


def part_image_url(part: Mapping[str, Any]) -> Any:
    """The URL of an ``image_url`` / ``input_image`` part (``None`` when missing)."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, Mapping) else value


def render_messages_with_images(messages: Sequence[Mapping[str, Any]], connector: MediaConnector,
                                param: str = "messages") -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages as the template takes them and their images (``PIL.Image.Image``, in order).

    Raises:
        InvalidRequestError: an unknown part type, a part without its field, or an image that cannot be loaded
            (``param`` names the part: ``messages[i].content[j]``).
    """
    rendered: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        has_image = False
        for j, part in enumerate(content):
            where = f"{param}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_pil":
                from tokenmill.multimodal.processing import image_list

                images.extend(image_list({"image": part.get("image_pil")}, where))
                parts.append({"type": "image"})
                has_image = True
            elif kind in ("image_url", "input_image"):
                images.append(connector.load_image(part_image_url(part), where))
                parts.append({"type": "image"})
                has_image = True
            else:
                raise InvalidRequestError(f"{where}: content part type {kind!r} is not supported (text, image_url)",
                                          param=where)
        if has_image:
            rendered.append({**message, "content": parts})
        else:
            rendered.append({**message, "content": "\n".join(p["text"] for p in parts)})
    return rendered, images
