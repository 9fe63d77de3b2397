"""A chat request's prompt: its messages (text parts joined, past calls and tool results) through the model's
chat template, and whether that is cheap enough to do on the event loop."""

from __future__ import annotations

from pdserve.json_writer import items_at_least
from pdserve.server.errors import bad_request
from pdserve.server.protocol import ChatCompletionRequest, ChatMessage
from pdserve.server.tools.chat import render_messages
from pdserve.tokenizer import Tokenizer

# OpenAI content parts that carry an image or a video: pdserve serves text models only (of a vision-language
# checkpoint, its text model: the vision tower is not loaded)
_MEDIA_PARTS = ("image_url", "input_image", "image", "video_url", "video")
# Messages of fewer characters than this (_size) are rendered through the chat template on the event loop, more
# in a worker thread
_RENDER_IN_PLACE = 1 << 16
_MESSAGE_SIZE = 64  # a message's role, its template's markup and its dict: 60 K short messages took ~0.5 s
_TOOLS_IN_PLACE = 1 << 12  # items in the tools' schemas (the template writes them as JSON)


def renders_in_place(req: ChatCompletionRequest) -> bool:
    """Whether rendering `req` holds the event loop too briefly to matter."""
    return _size(req.messages) < _RENDER_IN_PLACE and items_at_least(req.tools, _TOOLS_IN_PLACE) < _TOOLS_IN_PLACE


def _size(messages: list[ChatMessage]) -> int:
    """About how many characters of the messages a chat template reads: their strings' (contents, text parts,
    tool_call_ids, their calls' ids, names and arguments), and _MESSAGE_SIZE a message for the rest."""
    def chars(value) -> int:
        return len(value) if isinstance(value, str) else 0

    def call(c: dict) -> int:
        fn = c.get("function")
        return chars(c.get("id")) + (chars(fn.get("name")) + chars(fn.get("arguments")) if isinstance(fn, dict) else 0)

    def content(m: ChatMessage) -> int:
        if isinstance(m.content, list):
            return sum(chars(part.get("text")) for part in m.content)
        return chars(m.content)

    return sum(_MESSAGE_SIZE + content(m) + chars(m.tool_call_id) + sum(map(call, m.tool_calls or ()))
               for m in messages)


def prompt_text(tokenizer: Tokenizer, req: ChatCompletionRequest, tools) -> str:
    """The request's messages through the chat template."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content or ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") in _MEDIA_PARTS:
                    raise bad_request(f"messages[{i}].content: images are not served (a part of type "
                                      f"{part['type']!r}): pdserve serves the text model only, a vision-language "
                                      "checkpoint's without its vision tower; send only text parts "
                                      "({\"type\": \"text\", \"text\": ...})", "messages")
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content: only text parts ({{\"type\": \"text\", "
                                      f"\"text\": ...}}) are supported, got {part.get('type')!r}", "messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        messages.append({"role": m.role, "content": content, **m.model_dump(include={"tool_calls", "tool_call_id"},
                                                                            exclude_none=True)})
    messages, extra = render_messages(messages, tools, tokenizer.chat_template)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **extra)
    except ValueError as e:  # no template, or the template refused these messages
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    except Exception as e:  # jinja2 raises its own TemplateError (e.g. raise_exception in the template)
        raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
