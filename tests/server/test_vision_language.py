"""A model served from a vision-language checkpoint (Qwen3.5 as published: pdserve serves its text model, the
vision tower not loaded), through a real server and the official openai client: a chat message with an image
part is one 400 saying images are not served and what to send instead; text-only chat is answered."""

from __future__ import annotations

import pytest
from server_harness import openai_client, served

from pdserve.testing.tiny_qwen3_5 import make_tiny_qwen3_5

openai = pytest.importorskip("openai")
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_vl") / "m", num_layers=4)
    with served(model, max_model_len=256, num_kv_blocks=64, tokens_per_block=8) as srv:
        yield openai_client(srv)


@pytest.mark.parametrize("content", [[IMAGE], [{"type": "text", "text": "What is this?"}, IMAGE]],
                         ids=["image-only", "text-and-image"])
def test_an_image_part_is_a_400_saying_images_are_not_served(client, content):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=4)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "messages", err
    assert err["message"].startswith("messages[0].content: images are not served (a part of type 'image_url')"), err
    assert "send only text parts" in err["message"], err


def test_text_chat_is_answered(client):
    out = client.chat.completions.create(model="tiny", max_tokens=4, extra_body={"ignore_eos": True},
                                         messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
