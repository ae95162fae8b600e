"""cabin-serve on FastAPI's conventions: /openapi.json describes the chat completion request and response, /metrics
is Prometheus text from prometheus_client with the metric names it always had, and a request the models refuse
is a 400 in OpenAI's error shape naming the field. The app's engine thread is not started (no lifespan): nothing
here reaches the scheduler."""
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.server.app import ServeConfig, create_app

METRIC_NAMES = {
    "cabin_kv_bytes_budget", "cabin_kv_bytes_reserved", "cabin_kv_bytes_used", "cabin_kv_bytes_used_peak",
    "cabin_kv_blocks_total", "cabin_kv_blocks_free", "cabin_kv_blocks_cached", "cabin_kv_blocks_in_use",
    "cabin_prefix_hit_blocks_total", "cabin_prompt_tokens_total", "cabin_cached_tokens_total",
    "cabin_generated_tokens_total", "cabin_requests_finished_total", "cabin_engine_steps_total",
    "cabin_generated_tokens_per_second", "cabin_queue_length", "cabin_active_sequences",
    *(f"{histogram}_{part}" for histogram in ("cabin_time_to_first_token_seconds", "cabin_inter_token_latency_seconds")
      for part in ("bucket", "count", "sum", "created")),
    *(f"cabin_{counter}_{part}" for counter in ("asr_seconds", "audio_seconds", "audio_clips_transcribed",
                                                "audio_clips_reused", "audio_clips_refused")
      for part in ("total", "created")),
}
HTTP_NAMES = {"cabin_http_requests_total", "cabin_http_requests_created"}  # once a request was answered
PLAY = [{"role": "user", "content": "play"}]


def new_app(engine):
    scheduler = engine.new_core(engine.new_cache(KvCacheConfig("int8", 1 << 20)))
    return create_app(engine, scheduler, ServeConfig("tiny", OverflowPolicy("error")))


@pytest.fixture(scope="module")
def client(tiny_engine):
    return TestClient(new_app(tiny_engine))


def test_openapi_describes_the_chat_completion_request_and_response(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    request = schemas["ChatCompletionRequest"]
    assert {"messages", "model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature",
            "top_p", "seed", "stop", "n"} <= set(request["properties"])
    assert request["required"] == ["messages"]
    assert set(schemas["ChatMessage"]["properties"]["role"]["enum"]) == {"system", "user", "assistant", "tool"}
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format"} <= set(request["properties"])
    post = spec["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    answers = post["responses"]
    assert answers["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletion"}
    assert answers["4XX"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "422" not in answers  # every bad request is a 400
    assert client.get("/docs").status_code == 200


def test_metrics_parse_as_prometheus_text_with_every_name(client, tiny_engine):
    response = client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = {sample.name: sample.value for family in text_string_to_metric_families(response.text)
               for sample in family.samples}
    assert set(samples) - HTTP_NAMES == METRIC_NAMES
    assert samples["cabin_kv_bytes_budget"] == 1 << 20 and samples["cabin_kv_blocks_in_use"] == 0
    other = TestClient(new_app(tiny_engine)).get("/metrics").text  # each app its own registry: no clash
    assert {s.name for f in text_string_to_metric_families(other) for s in f.samples} - HTTP_NAMES == METRIC_NAMES


BAD = [
    ({"messages": PLAY, "temperature": "hot"}, "temperature", 'temperature must be a number from 0 to 2, got "hot"'),
    ({"messages": PLAY + [{"role": "robot", "content": "x"}]}, "messages[1].role",
     "messages[1].role must be one of system, user, assistant, tool, got 'robot'"),
    ({"messages": PLAY + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id",
     "messages[1].tool_call_id is missing; a tool message names the call it answers"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     'messages[0].content part 0: image_url must be {"url": "data:image/...;base64,..."}'),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content",
     'messages[0].content parts must be {"type": "text", "text": ...}, {"type": "image_url", "image_url": '
     '{"url": ...}} or {"type": "input_audio", "input_audio": {"data": ..., "format": "wav"}}'),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/cam.png"}}]}]}, "messages[0].content",
     "messages[0].content part 0: image_url.url must be a data: URL (data:image/png;base64,...); this server "
     "fetches no remote pictures: send the picture's bytes"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,@@@"}}]}]}, "messages[0].content",
     "messages[0].content part 0: image_url.url holds invalid base64 (Only base64 data is allowed); encode the "
     "picture again"),
    ({"messages": PLAY, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "stream_options.include_usage must be true or false, got 1"),
    ({"messages": PLAY, "n": 200}, "n", "n must be an integer from 1 to 128, got 200"),
    ({"messages": PLAY, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be an integer from 0 to 20, got 21"),
    ({"messages": PLAY, "top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"messages": PLAY, "frequency_penalty": "hot"}, "frequency_penalty",
     'frequency_penalty must be a number from -2 to 2, got "hot"'),
    ({"messages": PLAY, "top_p": 0}, "top_p", "top_p must be > 0 and <= 1, got 0"),
    ({"messages": PLAY, "stop": ["a"] * 5}, "stop", "stop must be a non-empty string or a list of at most 4 of them"),
    ({"model": "tiny"}, "messages", "messages must be a non-empty list of {role, content} objects"),
    ([PLAY], None, "the request body must be a JSON object with 'model' and 'messages'"),
]


@pytest.mark.parametrize("body, param, message", BAD, ids=[message for _, _, message in BAD])
def test_a_refused_request_is_a_400_in_openai_shape(client, body, param, message):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": None}}


def test_a_json_body_is_read_whatever_its_content_type(client):
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):  # curl -d sends the form type
        response = client.post("/v1/chat/completions", content=b'{"messages": []}',
                               headers={"content-type": content_type})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == ("messages must be a non-empty list of {role, content} "
                                                       "objects")


UNAPPLIED = [("logit_bias", {"42": 5}), ("frequency_penalty", 0.5), ("presence_penalty", -1),
             ("functions", [{"name": "f"}]), ("function_call", "auto")]


@pytest.mark.parametrize("field, value", UNAPPLIED, ids=[field for field, _ in UNAPPLIED])
def test_a_field_that_would_change_the_reply_and_is_not_applied_is_refused(client, field, value):
    response = client.post("/v1/chat/completions", json={"messages": PLAY, field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field} ") and "leave it out" in error["message"]


@pytest.mark.parametrize("field, value", [("tools", []), ("tool_choice", "none"), ("logprobs", False),
                                          ("response_format", {"type": "text"}), ("frequency_penalty", 0),
                                          ("logit_bias", {}), ("top_logprobs", 0)])
def test_the_neutral_value_of_an_unapplied_field_is_accepted(client, field, value):
    response = client.post("/v1/chat/completions", json={"messages": PLAY, "model": "other", field: value})
    assert response.status_code == 404  # past the body's checks: the unknown model is what is answered