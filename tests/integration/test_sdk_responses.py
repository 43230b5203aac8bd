"""The official openai SDK's Responses API against real gunicorn with the default model: create,
stream (checked event by event against the SDK's own event models), a function tool round trip,
a json_schema text format, and previous_response_id with the per-worker store."""
import importlib.util
import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location(
    "responses_http", Path(__file__).resolve().parents[1] / "http" / "test_responses.py")
conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conformance)

MODEL = "smollm2-135m-instruct"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False}}]
ASK = dict(model=MODEL, input="Name one colour.", max_output_tokens=24, temperature=0)


def test_create_and_stream_end_in_the_same_text(oai):
    body = oai.responses.create(**ASK)
    assert body.object == "response" and body.status in ("completed", "incomplete") and body.output_text
    assert body.usage.total_tokens == body.usage.input_tokens + body.usage.output_tokens
    with oai.responses.stream(**ASK) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response() if body.status == "completed" else None
    assert "".join(deltas) == body.output_text
    if final is not None:       # NOTE(sdk): its helper only finishes on response.completed
        assert final.output_text == body.output_text and final.usage.output_tokens == body.usage.output_tokens


def test_raw_stream_conforms_to_the_sdk_event_models(oai):
    with oai.responses.with_streaming_response.create(**ASK, stream=True) as raw:
        text = "\n".join(raw.iter_lines())
    final = conformance.check_stream(conformance.sse_events(text))
    assert final["status"] in ("completed", "incomplete") and final["output"][0]["type"] == "message"


def test_function_tool_round_trip(oai):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.responses.create(model=MODEL, input=question, tools=TOOLS, temperature=0, max_output_tokens=40,
                                 tool_choice={"type": "function", "name": "get_weather"})
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments).get("city"), str)
    followup = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 22})}]
    second = oai.responses.create(model=MODEL, input=followup, tools=TOOLS, temperature=0, max_output_tokens=24)
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens


def test_json_schema_text_format(oai):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20}},
              "required": ["colour"], "additionalProperties": False}
    body = oai.responses.create(model=MODEL, input="Name one colour as JSON.", temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "colour", "schema": schema,
                                                 "strict": True}})
    assert body.status == "completed" and body.text.format.type == "json_schema"
    assert isinstance(json.loads(body.output_text)["colour"], str)


def test_previous_response_id_continues_then_delete_forgets(oai):
    first = oai.responses.create(model=MODEL, input="My name is Ada.", instructions="Answer briefly.",
                                 max_output_tokens=12, temperature=0)
    second = oai.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                  instructions="Answer briefly.", max_output_tokens=12, temperature=0)
    # NOTE(history): the first turn, question and answer, is in the second prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id and oai.responses.retrieve(second.id).id == second.id
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.create(model=MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
