#!/usr/bin/env python3
"""Drives a running `bulkhead serve` with the official `openai` client, as a new
user would: a chat completion, a streamed one, several choices, a pydantic
model's structured output, a tool call and its result, and the error on an
oversized prompt. Usage: openai_client_check.py BASE_URL API_KEY MODEL_ID

Exit 0 and "ok" on success; exit 3 if the `openai` package is missing."""

import datetime
import decimal
import ipaddress
import re
import sys
import uuid
from typing import List, Literal, Optional, Tuple, Union

try:
    import openai
    from pydantic import AnyUrl, BaseModel, Field, HttpUrl, create_model
except ImportError:
    print("openai is not installed (pip install -r scripts/requirements.txt)")
    sys.exit(3)


class Owner(BaseModel):
    name: str = Field(max_length=12)


class Cat(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)
    weight_kg: float = Field(gt=0, le=12.5)
    chip: str = Field(pattern=r"^[A-Z]{2}-\d{4}$")
    color: Literal["black", "white", "orange", "grey"]
    toys: List[str] = Field(max_length=3)
    owner: Optional[Owner]


class Visit(BaseModel):
    """Fields pydantic writes a `format` for, which the server holds to it."""
    when: datetime.datetime
    day: datetime.date
    length: datetime.timedelta
    id: uuid.UUID
    address: ipaddress.IPv4Address
    site: AnyUrl
    floor_and_room: Tuple[int, int]


class Link(BaseModel):
    """HttpUrl: a uri of at most 2,083 characters."""
    url: HttpUrl


class Fish(BaseModel):
    kind: Literal["fish"]
    water: Literal["salt", "fresh"]


class Bird(BaseModel):
    kind: Literal["bird"]
    sings: bool


class Pets(BaseModel):
    pets: List[Union[Fish, Bird]] = Field(max_length=3)


class Tank(BaseModel):
    """pydantic's discriminated union: a oneOf told apart by `kind`."""
    pet: Union[Fish, Bird] = Field(discriminator="kind")


class Invoice(BaseModel):
    """Decimal: a number, or a string whose pattern needs lookahead (left out)."""
    total: decimal.Decimal
    currency: Literal["EUR", "USD"]


class GetWeather(BaseModel):
    """The current weather in a city."""
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


def main() -> None:
    base_url, key, model = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=300)

    models = [m.id for m in client.models.list()]
    assert models == [model], models

    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three primary colors."}],
        max_tokens=24,
        temperature=0,
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"
    assert text and ("Red" in text or "red" in text), text
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    pieces = []
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three primary colors."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert "".join(pieces) == text, ("".join(pieces), text)
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens

    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert completion.usage.completion_tokens == 8, completion.usage

    # Sampling options and log probabilities, through the client's own types.
    scored = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three primary colors."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"0": -100},
    )
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens, (len(content), scored.usage)
    assert "".join(bytes(t.bytes).decode("utf-8", "replace") for t in content) == scored.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content), content
    legacy = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=1
    )
    assert len(legacy.choices[0].logprobs.tokens) == 4, legacy.choices[0].logprobs
    assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text
    # A text scored, nothing generated: echo with max_tokens 0 (how
    # evaluation harnesses read a prompt's log probabilities).
    echoed = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=0, echo=True, logprobs=1
    )
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == "Once upon a time", echoed
    assert "".join(lp.tokens) == "Once upon a time", lp
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert all(l <= 0 for l in lp.token_logprobs[1:]), lp
    assert echoed.usage.completion_tokens == 0, echoed.usage
    # A batch of prompts, each scored (as lm-evaluation-harness sends them
    # at batch sizes above 1): prompt p's choices at p * n onwards.
    batch = client.completions.create(
        model=model, prompt=["Once upon a time", "The sky is"], max_tokens=0,
        echo=True, logprobs=1,
    )
    assert [c.index for c in batch.choices] == [0, 1], batch
    assert batch.choices[0].logprobs.token_logprobs == lp.token_logprobs, batch
    assert batch.choices[1].text == "The sky is", batch
    assert batch.usage.prompt_tokens == echoed.usage.prompt_tokens + len(batch.choices[1].logprobs.tokens), batch.usage

    # Several choices, whole and streamed, and vLLM's extras through extra_body.
    several = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=8,
        temperature=1,
        seed=11,
        n=3,
        extra_body={"min_tokens": 2, "top_k": 40},
    )
    assert [c.index for c in several.choices] == [0, 1, 2], several.choices
    assert several.usage.completion_tokens >= 6, several.usage
    streamed = {}
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=8,
        temperature=1,
        seed=11,
        n=3,
        stream=True,
        extra_body={"min_tokens": 2, "top_k": 40},
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in several.choices}, (streamed, several.choices)

    # Structured output: the client sends the pydantic model's schema and
    # parses the answer back into the model (it raises if it does not fit).
    def parsed_as(kind, prompt, max_tokens=200, **sampling):
        answer = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format=kind,
            max_tokens=max_tokens,
            **sampling,
        )
        value = answer.choices[0].message.parsed
        assert isinstance(value, kind) and answer.choices[0].finish_reason == "stop", answer
        return value

    cat = parsed_as(Cat, "Describe a cat in JSON.", temperature=0)
    assert len(cat.toys) <= 3 and len(cat.name) <= 20, cat
    # Formats (date-time, date, duration, uuid, ipv4, uri) and a tuple
    # (prefixItems): pydantic parses each field back into its type.
    parsed_as(Visit, "A visit to a web site, as JSON.", 300, temperature=1, seed=11)
    # A union of two models (anyOf of two objects, read side by side).
    pets = parsed_as(Pets, "List a fish and a bird as JSON.", temperature=0)
    assert all(isinstance(p, (Fish, Bird)) for p in pets.pets), pets
    # A URL of up to 2,083 characters: a greedy small model would go on
    # writing its path, so with a repetition penalty.
    link = parsed_as(
        Link,
        "A link to a news site, as JSON.",
        temperature=0,
        extra_body={"repetition_penalty": 1.3},
    )
    assert link.url.scheme in ("http", "https"), link
    invoice = parsed_as(Invoice, "An invoice total, as JSON.", temperature=0)
    assert isinstance(invoice.total, decimal.Decimal), invoice
    tank = parsed_as(Tank, "A pet for a tank, as JSON.", temperature=1, seed=3)
    assert isinstance(tank.pet, (Fish, Bird)), tank
    # vLLM's choice, through extra_body.
    label = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Classify the sentiment: I love this phone!"}],
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert label.choices[0].message.content in ("positive", "negative"), label
    # vLLM's regex, through extra_body: the whole answer matches it.
    phone = client.completions.create(
        model=model,
        prompt="Call us today at",
        max_tokens=24,
        temperature=1,
        seed=5,
        extra_body={"structured_outputs": {"regex": r" \(\d{3}\) \d{3}-\d{4}"}},
    )
    text = phone.choices[0].text
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", text, re.ASCII), text
    assert phone.choices[0].finish_reason == "stop", phone

    # Tools: a pydantic model as a strict function tool; the client parses
    # each call's arguments back into the model, whole and streamed.
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [openai.pydantic_function_tool(GetWeather)]
    called = client.chat.completions.parse(
        model=model, messages=question, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, temperature=0,
    )
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls", called
    assert message.content is None and len(message.tool_calls) == 1, message
    weather = message.tool_calls[0].function.parsed_arguments
    assert isinstance(weather, GetWeather), message
    with client.chat.completions.stream(
        model=model, messages=question, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, temperature=0,
    ) as stream:
        final = stream.get_final_completion()
    streamed_call = final.choices[0].message.tool_calls[0]
    assert streamed_call.function.parsed_arguments == weather, (streamed_call, weather)
    assert streamed_call.id == streamed_call.id.strip() and streamed_call.id.startswith("call_")
    # More tools than could be read side by side (each call is told apart
    # by its name, the first property): any of them may be called.
    many = [
        openai.pydantic_function_tool(create_model(f"Tool{i}", value=(int, ...)), name=f"tool_{i}")
        for i in range(23)
    ] + tools
    crowded = client.chat.completions.parse(
        model=model, messages=question, tools=many, tool_choice="required",
        max_tokens=120, temperature=1, seed=7,
    )
    assert crowded.choices[0].finish_reason == "tool_calls", crowded
    for call in crowded.choices[0].message.tool_calls:
        arguments = call.function.parsed_arguments
        if call.function.name == "GetWeather":
            assert isinstance(arguments, GetWeather), call
        else:
            assert re.fullmatch(r"tool_\d+", call.function.name), call
            assert isinstance(arguments.value, int), call
    # The call's result goes back; the model answers in text.
    answered = client.chat.completions.create(
        model=model,
        messages=question + [
            message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees"},
        ],
        tools=tools, tool_choice="none", max_tokens=16, temperature=0,
    )
    assert answered.choices[0].message.content, answered

    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello " * 5000}],
            max_tokens=16,
        )
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert e.code == "context_length_exceeded", e.code
    else:
        raise AssertionError("an oversized prompt was accepted")

    try:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", e.code
    else:
        raise AssertionError("an unknown model was accepted")

    bad = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong-key-0123456789", max_retries=0)
    try:
        bad.models.list()
    except openai.AuthenticationError:
        pass
    else:
        raise AssertionError("a wrong key was accepted")
    print("ok")


if __name__ == "__main__":
    main()
