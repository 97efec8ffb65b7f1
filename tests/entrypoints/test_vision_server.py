"""``tokenmill serve`` with a tiny Llava model, driven by the openai client: base64 images in chat messages,
two different images give different answers, the same image again hits the prefix cache; a corrupt image, too
many images and an image sent to the text-only default model (the package's shared server) are 400s naming
the field, and both servers keep serving (docs/multimodal.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai
import pytest

from tests.entrypoints.conftest import RealServer, run_server
from tests.models.vision_models import build_llava, data_url, random_image

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-llava"
QUESTION = "what is in this picture? "


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def llava_server(llava_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    args = [llava_dir, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--block-size", "4", "--max-num-batched-tokens", "64", "--served-model-name", MODEL,
            "--limit-mm-per-prompt", '{"image": 2}']
    with contextlib.contextmanager(run_server)(str(tmp_path_factory.mktemp("llava-server")), args) as server:
        yield server


def _client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, *urls: str, model: str = MODEL):
    content = [{"type": "text", "text": QUESTION}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True})


def _assert_400(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


def test_chat_with_images(llava_server, llava_dir):
    from transformers import AutoTokenizer

    client = _client(llava_server)
    image_start = len(AutoTokenizer.from_pretrained(llava_dir)(f"user: {QUESTION}")["input_ids"])
    first, second = data_url(random_image(11, 40, 30)), data_url(random_image(12, 30, 52), "JPEG")
    a = _ask(client, first)
    b = _ask(client, second)
    assert a.choices[0].message.content != b.choices[0].message.content
    assert a.usage.prompt_tokens > 16  # the image's 16 placeholder tokens are counted
    # another image: only the blocks before its placeholder are shared
    assert 0 < b.usage.prompt_tokens_details.cached_tokens <= image_start
    again = _ask(client, first)
    assert again.choices[0].message.content == a.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= image_start + 16  # the same image: its blocks too
    two = _ask(client, first, second)
    assert two.usage.prompt_tokens > 32 and two.choices[0].message.content


def test_bad_images_are_400s(llava_server):
    client = _client(llava_server)
    image = data_url(random_image(13, 28, 28))
    _assert_400(lambda: _ask(client, "data:image/png;base64,aGVsbG8gd29ybGQ="), "messages[0].content[1]")
    _assert_400(lambda: _ask(client, "data:image/png;base64,@@notbase64"), "messages[0].content[1]")
    _assert_400(lambda: _ask(client, "http://127.0.0.1:1/cat.png"), "messages[0].content[1]")
    _assert_400(lambda: _ask(client, "file:///etc/hostname"), "messages[0].content[1]")
    _assert_400(lambda: _ask(client, image, image, image), "messages")
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": image}}]
    _assert_400(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                       extra_body={"truncate_prompt_tokens": 8}),
                "truncate_prompt_tokens")
    assert _ask(client, image).choices[0].message.content  # still serving


def test_image_to_text_only_model_is_400(real_server):
    client = _client(real_server)
    model = client.models.list().data[0].id
    _assert_400(lambda: _ask(client, data_url(random_image(14, 28, 28)), model=model), "messages")
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.choices[0].message.content is not None


def test_responses_input_image_answers_as_chat(llava_server):
    client = _client(llava_server)
    url = data_url(random_image(15, 36, 36))
    chat = _ask(client, url)
    response = client.responses.create(
        model=MODEL, max_output_tokens=12, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                            {"type": "input_image", "image_url": url}]}])
    assert response.output_text == chat.choices[0].message.content
    _assert_400(lambda: client.responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"}]}]),
        "input")


def test_mm_processor_kwargs_reach_the_processor(llava_server):
    client = _client(llava_server)
    url = data_url(random_image(16, 30, 30))
    plain = _ask(client, url).choices[0].message.content
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]
    raw = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True,
                                                                    "mm_processor_kwargs": {"do_normalize": False}})
    assert raw.choices[0].message.content != plain  # other pixel values, another answer
