"""OpenAI tool calls on /v1/chat/completions, checked with the `openai` SDK's own models.

Scripted answers (a ReplayEngine behind the app, in process) pin the parsing exactly: calls
with ids and JSON-string arguments, the stream's `delta.tool_calls`, text that is not a call,
tool_choice, parallel_tool_calls and bad requests. Then the tiny embedded model, fine-tuned
here to call a weather tool (120 SFT steps on conversations whose assistant turns write a Qwen
2.5 `<tool_call>` with the city copied from the question, then answer from the tool's result),
is served by `python -m ptrain.serve` on loopback and the SDK runs the whole tool loop against
it, streaming and not: question -> tool_calls -> the tool runs here -> a `tool` message -> the
answer. The task is trivial on purpose: the test is of the protocol, not of the model.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.testclient import TestClient

import ptrain
from ptrain.rollout.replay import ReplayEngine
from ptrain.serve.openai_api import ToolCallStream, parse_tool_calls
from ptrain.serve.server import load_tokenizer, make_app
from tests.rollout.test_serve_process import start_server

WEATHER = {"Paris": "sunny", "Oslo": "snowy", "Lima": "foggy", "Cairo": "hot"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Qwen 2.5's layout in the embedded ChatML: tools listed in a system turn, each call a
# <tool_call> block after the assistant's text. The SFT rows below are this template's render.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
    " + '\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def call_block(city: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": city}}) + "\n</tool_call>"


def user(city: str) -> dict:
    return {"role": "user", "content": f"What is the weather in {city}?"}


# ---- scripted answers ----


class Replay(ReplayEngine):
    context_length = 256


@pytest.fixture(scope="module")
def replay(tiny_tokenizer):
    engine = Replay(tokenizer=tiny_tokenizer, eos_token_ids=[tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")])
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(replay, tiny_tokenizer):
    with TestClient(make_app(replay, tiny_tokenizer, served_model_name="tiny", chat_template=TEMPLATE)) as c:
        yield c


def chat(client, replay, answer, status=200, **body):
    """One chat request answered with `answer`: the SDK's ChatCompletion (or the error body)."""
    if answer is not None:
        replay.add([answer])
    r = client.post("/v1/chat/completions", json={"messages": [user("Oslo")], "tools": TOOLS, **body})
    assert r.status_code == status, r.text
    return sdk_completion(r.json()) if status == 200 else r.json()


def sdk_completion(body: dict) -> ChatCompletion:
    """The body as the SDK's ChatCompletion, validated. `metadata` is left out: SGLang's (and so
    ours) holds the weight-version spans, a list, where OpenAI's is string pairs; the SDK's
    client does not validate answers by default, so it takes them as they are."""
    return ChatCompletion.model_validate({k: v for k, v in body.items() if k != "metadata"})


def chat_stream(client, replay, answer, **body) -> tuple[list[ChatCompletionChunk], ChatCompletion]:
    """The stream's chunks as the SDK decodes them, and the completion its accumulator makes of them."""
    replay.add([answer])
    r = client.post("/v1/chat/completions", json={"messages": [user("Oslo")], "tools": TOOLS, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    return chunks, state.get_final_completion()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


TWO_CALLS = f"Let me look.\n{call_block('Oslo')}\n{call_block('Lima')}"


def test_calls_are_openai_tool_calls_and_the_stream_sends_them_as_openai_does(client, replay):
    whole = chat(client, replay, TWO_CALLS)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert calls_of(choice.message) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Lima"})]
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c.type == "function" and isinstance(c.function.arguments, str) for c in choice.message.tool_calls)

    chunks, streamed = chat_stream(client, replay, TWO_CALLS, stream_options={"include_usage": True})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    # per call: index, id, type and name with empty arguments, then the arguments
    assert [(c.index, c.id is not None, c.type, c.function.name, c.function.arguments) for c in calls] == [
        (0, True, "function", "get_weather", ""),
        (0, False, None, None, '{"city": "Oslo"}'),
        (1, True, "function", "get_weather", ""),
        (1, False, None, None, '{"city": "Lima"}'),
    ]
    assert chunks[-2].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens > 0
    (s,) = streamed.choices
    assert s.finish_reason == "tool_calls" and s.message.content == "Let me look."
    assert calls_of(s.message) == calls_of(choice.message)


@pytest.mark.parametrize(
    "answer",
    [
        "<tool_call>\n{'name': 'get_weather'}\n</tool_call>",  # not JSON
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # no such tool
        '<tool_call>\n{"arguments": {"city": "Oslo"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}',  # never closed
        "I think <tool_call is not a tag.",
    ],
)
def test_text_that_is_not_a_call_stays_content_as_written(client, replay, answer):
    (choice,) = chat(client, replay, answer).choices
    assert choice.message.content == answer and choice.message.tool_calls is None and choice.finish_reason == "stop"
    chunks, streamed = chat_stream(client, replay, answer)
    assert streamed.choices[0].message.content == answer and not streamed.choices[0].message.tool_calls


def test_parallel_tool_calls_false_keeps_the_first_call(client, replay):
    (choice,) = chat(client, replay, TWO_CALLS, parallel_tool_calls=False).choices
    assert calls_of(choice.message) == [("get_weather", {"city": "Oslo"})]
    _, streamed = chat_stream(client, replay, TWO_CALLS, parallel_tool_calls=False)
    assert calls_of(streamed.choices[0].message) == [("get_weather", {"city": "Oslo"})]


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(client, replay, tiny_tokenizer):
    (choice,) = chat(client, replay, TWO_CALLS, tool_choice="none").choices
    assert choice.message.content == TWO_CALLS and choice.finish_reason == "stop"
    assert "Tools:" not in tiny_tokenizer.decode(replay.requests[-1].input_ids)


@pytest.mark.parametrize(
    "tool_choice, prefill, answer",
    [
        ("required", "<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
        (NAMED, '<tool_call>\n{"name": "get_weather", "arguments": ', '{"city": "Oslo"}}\n</tool_call>'),
    ],
)
def test_required_and_named_tool_choice_start_the_reply_with_the_call(
    client, replay, tiny_tokenizer, tool_choice, prefill, answer
):
    (choice,) = chat(client, replay, answer, tool_choice=tool_choice).choices
    prompt = tiny_tokenizer.decode(replay.requests[-1].input_ids)
    assert prompt.endswith("<|im_start|>assistant\n" + prefill)
    assert choice.finish_reason == "tool_calls" and calls_of(choice.message) == [("get_weather", {"city": "Oslo"})]
    assert choice.message.content is None
    _, streamed = chat_stream(client, replay, answer, tool_choice=tool_choice)
    assert calls_of(streamed.choices[0].message) == [("get_weather", {"city": "Oslo"})]


def test_calls_and_tool_results_render_back_as_the_model_wrote_them(client, replay, tiny_tokenizer):
    # what the SDK sends back: the assistant message with its calls (arguments a JSON string), then the result
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        user("Oslo"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "snowy"},
    ]
    replay.add(["It is snowy."])
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
    (choice,) = sdk_completion(r.json()).choices
    assert choice.message.content == "It is snowy." and choice.finish_reason == "stop"
    assert tiny_tokenizer.decode(replay.requests[-1].input_ids) == (
        "<|im_start|>system\nTools: get_weather<|im_end|>\n<|im_start|>user\nWhat is the weather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{call_block('Oslo')}<|im_end|>\n<|im_start|>tool\nsnowy<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_stream_and_the_whole_answer_read_text_alike():
    texts = [TWO_CALLS, "A <tool_call>{}</tool_call> B", f"A {call_block('Lima')} B\n", "plain  text \n", "<tool_ca"]
    for text in texts:
        content, calls = parse_tool_calls(text, ["get_weather"])
        stream = ToolCallStream(["get_weather"])
        events = [e for k in range(1, len(text) + 1) for e in stream.feed(text[:k], final=k == len(text))]
        assert "".join(v for kind, v in events if kind == "content") == content, text
        assert [v["function"] for kind, v in events if kind == "call"] == [c["function"] for c in calls]
    assert parse_tool_calls(f"A {call_block('Lima')} B\n", ["get_weather"])[0] == "A B\n"


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": []}


@pytest.mark.parametrize(
    "body, message",
    [
        ({"tools": {"get_weather": {}}}, "tools: must be a list of tool objects"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type: only 'function' tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]: must be {'type': 'function'"),
        ({"tools": TOOLS * 2}, "tools[1].function.name: 'get_weather' is declared twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters: must be a JSON Schema object",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice: must be 'none', 'auto', 'required' or"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice: 'required' needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function.name: 'f' is not"),
        ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "other kinds (allowed_tools, custom)"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls: must be true or false"),
        ({"functions": [{"name": "f"}]}, "functions: the deprecated functions API is not supported"),
        (
            {
                "messages": [user("Oslo"), {"role": "assistant", "content": "Let me"}],
                "tool_choice": "required",
                "continue_final_message": True,
            },
            "cannot continue_final_message",
        ),
        (
            {"messages": [user("Oslo"), {"role": "tool", "tool_call_id": "c", "content": None}]},
            "messages[1].content: a tool message needs content",
        ),
        (
            {"messages": [user("Oslo"), {**ASSISTANT_CALL, "tool_calls": [{"id": "c", "function": {}}]}]},
            "messages[1].tool_calls[0]: must be {'id': ..., 'type': 'function'",
        ),
        (
            {
                "messages": [
                    user("Oslo"),
                    {**ASSISTANT_CALL, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": [1]}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments: must be a JSON object as a string",
        ),
        (
            {"messages": [{**user("Oslo"), "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
            "messages[0].tool_calls: only assistant messages carry tool calls",
        ),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id: must be"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(client, replay, body, message):
    err = chat(client, replay, None, status=400, **body)
    assert err["object"] == "error" and message in err["message"], err["message"]


def test_tools_on_a_template_without_tool_calls_say_how_to_serve_them(replay, tiny_tokenizer):
    with TestClient(make_app(replay, tiny_tokenizer)) as c:  # the embedded ChatML: no <tool_call>
        r = c.post("/v1/chat/completions", json={"messages": [user("Oslo")], "tools": TOOLS})
        assert r.status_code == 400 and "--chat-template FILE" in r.json()["message"]
    with TestClient(make_app(replay, tiny_tokenizer, tool_call_parser="none")) as c:  # raw text, as asked
        replay.add([call_block("Oslo")])
        r = c.post("/v1/chat/completions", json={"messages": [user("Oslo")], "tools": TOOLS})
        assert r.json()["choices"][0]["message"]["content"] == call_block("Oslo")
        r = c.post("/v1/chat/completions", json={"messages": [user("Oslo")], "tools": TOOLS, "tool_choice": NAMED})
        assert r.status_code == 400 and "--tool-call-parser none" in r.json()["message"]


# ---- a model fine-tuned to call the tool, served as a subprocess, driven by the SDK ----


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    """The tiny embedded model after a short SFT on get_weather conversations (about 15 s on
    2 CPU cores); its export folder, with a generation_config.json that ends a turn at
    <|im_end|> as Qwen's does."""
    root = tmp_path_factory.mktemp("tool_sft")
    rng = random.Random(0)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(256):
            city = rng.choice(list(WEATHER))
            messages = [
                {"role": "system", "content": "Tools: get_weather"},  # the TEMPLATE's render of TOOLS
                user(city),
                {"role": "assistant", "content": call_block(city)},
                {"role": "tool", "content": WEATHER[city]},
                {"role": "assistant", "content": f"It is {WEATHER[city]}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    result = ptrain.sft(
        None,
        run_dir=str(root / "run"),
        model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, max_seq_len=256),
        data=dict(source="jsonl", train_path=str(root / "train.jsonl"), packing=False),
        train=dict(steps=120, global_batch_size=16, seq_len=144, eval_every=0, eval_batches=0, eval_generate=0),
        optim=dict(lr=3e-3, warmup_steps=10),
        checkpoint=dict(async_save=False),
        logging=dict(console=False, tensorboard=False),
    )
    assert result.metrics["train/token_accuracy"] > 0.95, result.metrics
    with open(os.path.join(result.export, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    im_end = load_tokenizer(result.export).convert_tokens_to_ids("<|im_end|>")
    with open(os.path.join(result.export, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [im_end, eos], "temperature": 0.0}, f)
    return result.export


@pytest.fixture(scope="module")
def sdk(tool_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool_serve")
    template = folder / "tools.jinja"
    template.write_text(TEMPLATE)
    # one row and no warm-up request: fewer programs to compile than the defaults
    srv = start_server(
        tool_model, str(folder / "server.log"), "--chat-template", str(template),
        "--context-length", "256", "--max-running-requests", "1", "--skip-server-warmup",
    )  # fmt: skip
    yield OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.proc.kill()
    srv.proc.wait(30)


def get_weather(city: str) -> str:
    """The tool, run here, on the client's side."""
    return WEATHER.get(city, "unknown")


def ask(sdk, messages, stream: bool, **kw) -> ChatCompletion:
    """One turn through the SDK; a stream is put together by the SDK's own accumulator."""
    if not stream:
        return sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=80, **kw)
    state = ChatCompletionStreamState()
    for chunk in sdk.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=80, stream=True, **kw
    ):
        assert isinstance(chunk, ChatCompletionChunk)
        state.handle_chunk(chunk)
    return state.get_final_completion()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_sdk_runs_a_tool_loop_against_a_fine_tuned_model(sdk, stream):
    for city in ("Oslo", "Cairo"):
        messages: list = [user(city)]
        first = ask(sdk, messages, stream)
        (choice,) = first.choices
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        result = get_weather(**json.loads(call.function.arguments))
        assert result == WEATHER[city]
        # the SDK's own message object goes back as the assistant turn, then the tool's result
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": result}]
        second = ask(sdk, messages, stream)
        (answer,) = second.choices
        assert answer.finish_reason == "stop" and not answer.message.tool_calls
        assert answer.message.content == f"It is {result}."


@pytest.mark.slow
def test_a_named_tool_choice_gets_that_call_from_the_fine_tuned_model(sdk):
    (choice,) = ask(sdk, [user("Lima")], False, tool_choice=NAMED).choices
    assert choice.finish_reason == "tool_calls" and calls_of(choice.message) == [("get_weather", {"city": "Lima"})]
