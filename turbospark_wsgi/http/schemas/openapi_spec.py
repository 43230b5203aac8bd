"""The OpenAPI 3.1 description served at GET /openapi.json: every route, the main request and
response fields, and each route family's error envelope. A test keeps its paths and methods equal
to the app's route table."""

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_NULL_STR = {"type": ["string", "null"]}
_OBJ = {"type": "object"}


def _ref(name):
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema):
    return {"application/json": {"schema": schema}}


_SAMPLING = {
    "model": _STR, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "top_k": _INT,
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": _NUM, "seed": _INT, "stream": _BOOL, "ignore_eos": _BOOL,
    "speculative": {"type": "boolean", "description": "false: no speculative decoding for this request "
                                                      "(the output is the same either way)"},
    "stop": {"oneOf": [_STR, {"type": "array", "items": _STR}, {"type": "null"}]},
    "logit_bias": {"type": "object", "additionalProperties": _NUM},
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "cache_salt": _ref("CacheSalt"),
}
_CACHE_SALT = {"type": "string", "minLength": 1, "maxLength": 1024,
               "description": "only requests with the same salt share cached prompt prefixes (vLLM's); "
                              "with TURBOSPARK_CACHE_ISOLATION it comes after the key's own"}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                         "completion_tokens_details": {"type": "object", "properties": {
                             "accepted_prediction_tokens": _INT, "rejected_prediction_tokens": _INT}}}}
_TRUNCATE = {"type": "integer", "minimum": -1, "not": {"const": 0},
             "description": "keep the last N tokens of each prompt or input (-1: the model's limit; vLLM's)"}

_SCHEMAS = {
    "CacheSalt": _CACHE_SALT,
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": _STR, "type": _STR, "param": _NULL_STR, "code": _NULL_STR}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                              "properties": {"type": _STR, "message": _STR}}}},
    "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": dict(
        _SAMPLING, prompt={"oneOf": [_STR, {"type": "array", "items": _INT, "minItems": 1},
                                     {"type": "array", "items": _STR, "minItems": 1, "maxItems": 16},
                                     {"type": "array", "minItems": 1, "maxItems": 16,
                                      "items": {"type": "array", "items": _INT, "minItems": 1}}],
                           "description": "one prompt, or a list (TURBOSPARK_MAX_PROMPTS, default 16): choice j of "
                                          "prompt p has index p * n + j"},
        add_special_tokens=_BOOL, add_special=_BOOL,
        max_tokens={"type": "integer", "minimum": 0, "description": "0 only with echo (score the prompt)"},
        n={"type": "integer", "minimum": 1, "maximum": 20}, best_of={"type": "integer", "minimum": 1, "maximum": 20},
        logprobs={"type": "integer", "minimum": 0, "maximum": 20}, echo=_BOOL,
        truncate_prompt_tokens=_TRUNCATE)},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                   "properties": {"id": _STR, "object": {"const": "text_completion"}, "created": _INT,
                                  "model": _STR, "usage": _USAGE, "choices": {"type": "array", "items": {
                                      "type": "object", "required": ["text", "index", "finish_reason"],
                                      "properties": {"text": _STR, "index": _INT,
                                                     "finish_reason": _NULL_STR}}}}},
    "ChatMessage": {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [_STR, {"type": "null"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": _STR}}}]},
        "name": _STR, "tool_call_id": _STR, "tool_calls": {"type": "array", "items": _OBJ}}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": dict(
        _SAMPLING, messages={"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        max_tokens={"type": "integer", "minimum": 1}, max_completion_tokens={"type": "integer", "minimum": 1},
        tools={"type": "array", "items": _OBJ}, tool_choice={"oneOf": [_STR, _OBJ]},
        parallel_tool_calls=_BOOL, n={"type": "integer", "minimum": 1, "maximum": 20}, logprobs=_BOOL,
        top_logprobs={"type": "integer", "minimum": 0, "maximum": 20}, response_format=_OBJ,
        truncate_prompt_tokens=_TRUNCATE)},
    "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                       "properties": {"id": _STR, "object": {"const": "chat.completion"}, "created": _INT,
                                      "model": _STR, "usage": _USAGE, "choices": {"type": "array", "items": {
                                          "type": "object", "required": ["index", "message", "finish_reason"],
                                          "properties": {"index": _INT, "message": _OBJ,
                                                         "finish_reason": _NULL_STR}}}}},
    "AnthropicMessage": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]}}},
    "MessagesRequest": {"type": "object", "required": ["messages", "max_tokens"], "properties": {
        "model": _STR, "messages": {"type": "array", "minItems": 1, "items": _ref("AnthropicMessage")},
        "max_tokens": {"type": "integer", "minimum": 1}, "system": {"oneOf": [_STR, {"type": "array"}]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1}, "top_p": _NUM, "top_k": _INT,
        "stop_sequences": {"type": "array", "items": _STR}, "stream": _BOOL,
        "tools": {"type": "array", "items": _OBJ}, "tool_choice": _OBJ, "thinking": _OBJ}},
    "Message": {"type": "object", "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
                "properties": {"id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"},
                               "content": {"type": "array", "items": _OBJ}, "model": _STR,
                               "stop_reason": _NULL_STR, "stop_sequence": _NULL_STR,
                               "usage": {"type": "object", "properties": {"input_tokens": _INT,
                                                                          "output_tokens": _INT}}}},
    "CountTokensRequest": {"type": "object", "required": ["messages"], "properties": {
        "model": _STR, "messages": {"type": "array", "minItems": 1, "items": _ref("AnthropicMessage")},
        "system": {"oneOf": [_STR, {"type": "array"}]}, "tools": {"type": "array", "items": _OBJ}}},
    "ResponseInputItem": {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
            "content": {"oneOf": [_STR, {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": _STR}}}]}}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"const": "function_call"}, "call_id": _STR, "name": _STR, "arguments": _STR}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"}, "call_id": _STR, "output": _STR}},
        {"type": "object", "required": ["type"], "properties": {
            "type": {"const": "reasoning"}, "content": {"type": "array", "items": {
                "type": "object", "properties": {"type": {"const": "reasoning_text"}, "text": _STR}}}}}]},
    "ResponseCreateRequest": {"type": "object", "required": ["input"], "properties": {
        "model": _STR, "input": {"oneOf": [_STR, {"type": "array", "minItems": 1, "items": _ref("ResponseInputItem")}]},
        "instructions": _NULL_STR, "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "stream": _BOOL, "store": _BOOL,
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": _STR, "description": _STR, "parameters": _OBJ,
            "strict": _BOOL}}},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                          "name": _STR}}]},
        "parallel_tool_calls": _BOOL, "previous_response_id": _NULL_STR,
        "text": {"type": "object", "properties": {"format": {"type": "object", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}, "name": _STR, "schema": _OBJ,
            "strict": _BOOL}}}},
        "reasoning": {"type": "object", "properties": {
            "effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}}},
        "metadata": {"type": "object", "additionalProperties": _STR}, "cache_salt": _ref("CacheSalt")}},
    "Response": {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
                 "properties": {"id": _STR, "object": {"const": "response"}, "created_at": _INT,
                                "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
                                "model": _STR, "output": {"type": "array", "items": _OBJ},
                                "usage": {"type": ["object", "null"], "properties": {
                                    "input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT}}}},
    "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                        "properties": {"id": _STR, "object": {"const": "response"}, "deleted": _BOOL}},
    "TokenizeRequest": {"type": "object", "properties": {
        "model": _STR, "content": _STR, "prompt": _STR, "add_special": _BOOL, "add_special_tokens": _BOOL,
        "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "tools": {"type": "array", "items": _OBJ}, "chat_template_kwargs": _OBJ}},
    "Tokens": {"type": "object", "required": ["tokens", "count", "max_model_len"],
               "properties": {"tokens": {"type": "array", "items": _INT}, "count": _INT, "max_model_len": _INT}},
    "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
        "model": _STR, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
    "Detokenized": {"type": "object", "required": ["prompt", "content"],
                    "properties": {"prompt": _STR, "content": _STR}},
    "TokenizerInfo": {"type": "object", "required": ["tokenizer_class", "eos_token"], "properties": {
        "tokenizer_class": _STR, "name_or_path": _STR, "bos_token": _NULL_STR, "eos_token": _NULL_STR,
        "pad_token": _NULL_STR, "add_bos_token": _BOOL, "add_eos_token": _BOOL, "model_max_length": _INT,
        "chat_template": _NULL_STR}},
    "TokenCount": {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": _INT}},
    "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
              "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                             "loaded": _BOOL, "kind": {"enum": ["generation", "embedding", "rerank"]},
                             "capabilities": {"type": "array", "items": {"enum": ["generation", "embedding",
                                                                                  "rerank"]}},
                             "chat_template": {"type": "object", "required": ["usable"],
                                               "properties": {"usable": _BOOL, "reason": _STR}},
                             "parent": {"type": "string", "description": "a LoRA adapter's base model"}}},
    "LoadLoraAdapterRequest": {"type": "object", "required": ["lora_name", "lora_path"], "properties": {
        "lora_name": {"type": "string", "minLength": 1, "maxLength": 256},
        "lora_path": {"type": "string", "minLength": 1, "maxLength": 4096,
                      "description": "a PEFT adapter directory inside the models directory"}}},
    "UnloadLoraAdapterRequest": {"type": "object", "required": ["lora_name"], "properties": {
        "lora_name": {"type": "string", "minLength": 1, "maxLength": 256}}},
    "EmbeddingRequest": {"type": "object", "required": ["input"], "properties": {
        "model": _STR, "user": _STR, "dimensions": {"type": "integer", "minimum": 1,
                                                    "description": "only for models trained for it (Matryoshka)"},
        "encoding_format": {"enum": ["float", "base64"]}, "truncate_prompt_tokens": _TRUNCATE,
        "input": {"oneOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                            {"type": "array", "minItems": 1,
                             "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}}],
                  "description": "at most TURBOSPARK_MAX_EMBEDDING_INPUTS items (default 2048)"}}},
    "ModerationRequest": {"type": "object", "required": ["input"], "properties": {
        "model": _STR,
        "input": {"oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1},
                            {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                                "type": {"enum": ["text", "image_url"]}, "text": _STR}}}],
                  "description": "a list of content parts is one input; images are not read"}}},
    "ModerationList": {"type": "object", "required": ["id", "model", "results"], "properties": {
        "id": _STR, "model": _STR,
        "results": {"type": "array", "items": {"type": "object", "required": ["flagged", "categories"], "properties": {
            "flagged": _BOOL,
            "categories": {"type": "object", "additionalProperties": _BOOL,
                           "description": "one per input guardrail rule of the caller, by its id"},
            "category_scores": {"type": "object", "additionalProperties": _NUM},
            "category_applied_input_types": {"type": "object",
                                             "additionalProperties": {"type": "array", "items": _STR}}}}}}},
    "EmbeddingList": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"const": "list"}, "model": _STR,
        "usage": {"type": "object", "properties": {"prompt_tokens": _INT, "total_tokens": _INT}},
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                            "properties": {"object": {"const": "embedding"}, "index": _INT,
                                                           "embedding": {"oneOf": [
                                                               {"type": "array", "items": _NUM}, _STR]}}}}}},
    "RerankRequest": {"type": "object", "required": ["query", "documents"], "properties": {
        "model": _STR, "query": {"type": "string", "minLength": 1},
        "documents": {"type": "array", "minItems": 1, "items": {"oneOf": [_STR, {
            "type": "object", "required": ["text"], "properties": {"text": _STR}}]},
                      "description": "at most TURBOSPARK_RERANK_MAX_DOCUMENTS (default 1000)"},
        "top_n": {"type": "integer", "minimum": 1, "description": "the best N (default: all)"},
        "return_documents": {"type": "boolean", "description": "echo each document's text (default true)"}}},
    "RerankList": {"type": "object", "required": ["id", "model", "results", "usage"], "properties": {
        "id": _STR, "model": _STR, "usage": _ref("PairUsage"),
        "results": {"type": "array", "description": "highest relevance_score first", "items": {
            "type": "object", "required": ["index", "relevance_score", "truncated"], "properties": {
                "index": _INT, "relevance_score": _NUM, "document": {"type": "object", "properties": {"text": _STR}},
                "truncated": {"type": "boolean", "description": "the document's tail was cut to fit the model"}}}}}},
    "ScoreRequest": {"type": "object", "required": ["text_1", "text_2"], "properties": {
        "model": _STR, "text_1": {"oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1}]},
        "text_2": {"oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1}],
                   "description": "one text_1 against each text_2, or as many of each, scored pairwise"}}},
    "ScoreList": {"type": "object", "required": ["id", "object", "created", "model", "data", "usage"], "properties": {
        "id": _STR, "object": {"const": "list"}, "created": _INT, "model": _STR, "usage": _ref("PairUsage"),
        "data": {"type": "array", "items": {"type": "object", "required": ["index", "object", "score"], "properties": {
            "index": _INT, "object": {"const": "score"}, "score": _NUM, "truncated": _BOOL}}}}},
    "PairUsage": {"type": "object", "properties": {"prompt_tokens": _INT, "total_tokens": _INT}},
    "ModelList": {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
    "Health": {"type": "object", "required": ["status", "model", "queue"], "properties": {
        "status": {"enum": ["ok", "loading", "error"]}, "model": _STR, "backend": _NULL_STR,
        "queue": {"type": "object", "properties": {"waiting": _INT, "running": _INT, "max_waiting": _INT}}}},
}

_COUNTS = {"type": "object", "properties": {"total": _INT, "completed": _INT, "failed": _INT}}
_SCHEMAS.update({
    "File": {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
             "properties": {"id": _STR, "object": {"const": "file"}, "bytes": _INT, "created_at": _INT,
                            "filename": _STR, "purpose": _STR, "status": _STR}},
    "FileList": {"type": "object", "properties": {"object": {"const": "list"},
                                                  "data": {"type": "array", "items": _ref("File")},
                                                  "has_more": _BOOL}},
    "FileDeleted": {"type": "object", "properties": {"id": _STR, "object": {"const": "file"}, "deleted": _BOOL}},
    "FileUpload": {"type": "object", "required": ["purpose", "file"],
                   "properties": {"purpose": {"enum": ["batch", "user_data"]},
                                  "file": {"type": "string", "format": "binary"}}},
    "BatchCreateRequest": {"type": "object", "required": ["input_file_id", "endpoint"], "properties": {
        "input_file_id": _STR,
        "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]},
        "completion_window": {"type": "string", "description": "24h (or any duration such as 30m, 90s; at most 168h)"},
        "metadata": {"type": "object", "additionalProperties": _STR}}},
    "Batch": {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "completion_window",
                                             "status", "created_at"], "properties": {
        "id": _STR, "object": {"const": "batch"}, "endpoint": _STR, "input_file_id": _STR,
        "completion_window": _STR, "created_at": _INT,
        "status": {"enum": ["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                            "cancelling", "cancelled"]},
        "output_file_id": _NULL_STR, "error_file_id": _NULL_STR, "request_counts": _COUNTS}},
    "BatchList": {"type": "object", "properties": {"object": {"const": "list"},
                                                   "data": {"type": "array", "items": _ref("Batch")},
                                                   "has_more": _BOOL}},
})

_SSE = {"text/event-stream": {"schema": _STR}}


def _post(summary, request, response, error="OpenAIError", stream=True):
    content = dict(_json(_ref(response)), **(_SSE if stream else {}))
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(_ref(request))},
        "responses": {"200": {"description": "the result (an SSE stream when `stream` is true)",
                              "content": content},
                      "default": {"description": "an error in this route family's envelope",
                                  "content": _json(_ref(error))}}}}


def _text_post(summary, request):
    op = _post(summary, request, request, stream=False)
    op["post"]["responses"]["200"] = {"description": "a line saying it was done (vLLM's text)",
                                      "content": {"text/plain": {"schema": _STR}}}
    return op


def _get(summary, response_content, path_params=(), error="OpenAIError", extra=None, query_params=()):
    op = {"summary": summary,
          "responses": dict({"200": {"description": "OK", "content": response_content},
                             "default": {"description": "an error", "content": _json(_ref(error))}},
                            **(extra or {}))}
    if path_params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": _STR} for p in path_params]
    if query_params:
        op["parameters"] = [{"name": p, "in": "query", "required": False, "schema": _STR} for p in query_params]
    return {"get": op}


def _delete(summary, response_content, path_params):
    return {"delete": _get(summary, response_content, path_params)["get"]}


def spec(version="0"):
    """The OpenAPI document as a dict."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "TurboSpark WSGI", "version": version,
                 "description": "OpenAI- and Anthropic-compatible inference server. See DEVIATIONS.md."},
        "components": {"schemas": _SCHEMAS, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}, {"apiKey": []}, {}],
        "paths": {
            "/v1/completions": _post("Raw-prompt completion", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/embeddings": _post("Sentence embeddings (embedding models only)", "EmbeddingRequest",
                                    "EmbeddingList", stream=False),
            **{path: _post("Documents ranked by a cross-encoder's relevance to a query (reranking models only)",
                           "RerankRequest", "RerankList", stream=False)
               for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
            "/v1/score": _post("Relevance scores of text pairs from a cross-encoder (vLLM's shape)", "ScoreRequest",
                               "ScoreList", stream=False),
            "/v1/moderations": _post("Which of the caller's input guardrail rules (TURBOSPARK_GUARDRAILS) "
                                     "a text matches", "ModerationRequest", "ModerationList", stream=False),
            "/v1/messages": _post("Anthropic Messages", "MessagesRequest", "Message", "AnthropicError"),
            "/v1/messages/count_tokens": _post(
                "Anthropic token count", "CountTokensRequest", "TokenCount", "AnthropicError", stream=False),
            "/v1/responses": _post("OpenAI Responses (stored per worker for GET and previous_response_id)",
                                   "ResponseCreateRequest", "Response"),
            "/v1/responses/{response_id}": {
                **_get("A stored response of this worker", _json(_ref("Response")), ("response_id",)),
                **_delete("Forget a stored response", _json(_ref("ResponseDeleted")), ("response_id",))},
            "/v1/files": {
                "post": dict(_post("Upload a file (purpose 'batch': a JSONL batch input)", "FileUpload", "File",
                                   stream=False)["post"],
                             requestBody={"required": True, "content": {"multipart/form-data": {
                                 "schema": _ref("FileUpload")}}}),
                **_get("This key's files", _json(_ref("FileList")), query_params=("purpose", "after", "limit"))},
            "/v1/files/{file_id}": {
                **_get("One of this key's files", _json(_ref("File")), ("file_id",)),
                **_delete("Delete a file", _json(_ref("FileDeleted")), ("file_id",))},
            "/v1/files/{file_id}/content": _get("A file's bytes", {"application/octet-stream": {"schema": _STR}},
                                                ("file_id",)),
            "/v1/batches": {
                **_post("Create a batch over an uploaded file; it runs below live traffic", "BatchCreateRequest",
                        "Batch", stream=False),
                **_get("This key's batches, newest first", _json(_ref("BatchList")), query_params=("after", "limit"))},
            "/v1/batches/{batch_id}": _get("One of this key's batches", _json(_ref("Batch")), ("batch_id",)),
            "/v1/batches/{batch_id}/cancel": {"post": dict(
                _post("Cancel a batch (its finished lines are kept)", "BatchCreateRequest", "Batch",
                      stream=False)["post"], parameters=[{"name": "batch_id", "in": "path", "required": True,
                                                          "schema": _STR}], requestBody={"required": False,
                                                                                         "content": {}})},
            "/v1/models": _get("Installed models", _json(_ref("ModelList"))),
            "/v1/models/{model_id}": _get("One installed model", _json(_ref("Model")), ("model_id",)),
            "/v1/load_lora_adapter": _text_post("Register a LoRA adapter (vLLM's); requests select it by "
                                                "its name as `model`", "LoadLoraAdapterRequest"),
            "/v1/unload_lora_adapter": _text_post("Forget a LoRA adapter registered at run time (vLLM's)",
                                                  "UnloadLoraAdapterRequest"),
            "/tokenize": _post("Token ids of a prompt or chat, as generation would see them", "TokenizeRequest",
                               "Tokens", stream=False),
            "/detokenize": _post("Text of token ids", "DetokenizeRequest", "Detokenized", stream=False),
            "/tokenizer_info": _get("The tokenizer's special tokens, BOS rule and chat template (vLLM's shape)",
                                    _json(_ref("TokenizerInfo")), query_params=("model",)),
            "/health": _get("Readiness", _json(_ref("Health")),
                            extra={"503": {"description": "not ready", "content": _json(_ref("Health"))}}),
            "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": _STR}}),
            "/openapi.json": _get("This document", _json(_OBJ)),
        },
    }
