"""POST /tokenize and /detokenize: request bodies in, response bodies out.

    {"model"?, "content" | "prompt" | "messages" (+ "tools", "chat_template_kwargs"),
     "add_special_tokens" | "add_special"?}  -> {"tokens": [...], "count": N, "max_model_len": C}
    {"model"?, "tokens": [...]} -> {"prompt": "...", "content": "..."}    (vLLM's and llama.cpp's key)
    GET /tokenizer_info -> vLLM's shape: {"tokenizer_class", "bos_token", "eos_token", "chat_template", ...}

Text is tokenized as /v1/completions does it (BOS where the model's own rule puts one, none when
add_special_tokens / add_special is false); messages as /v1/chat/completions does it, so `count`
equals that route's `usage.prompt_tokens`.
"""
from ...errors import InvalidRequest
from ...serving.chat_plan import ChatPart
from ...serving.service import GenerationRequest
from .chat_messages import parse_messages, parse_tool_choice, parse_tools
from .common import TOKEN_ID_LIMIT, expect_object, is_int, model_name, type_name
from .openai import add_special


def parse_tokenize(doc):
    """-> a GenerationRequest: text, or messages as a ChatPart (the service plans its template)."""
    expect_object(doc)
    model = model_name(doc)
    if doc.get("messages") is not None:
        tools = parse_tools(doc.get("tools"))
        choice = parse_tool_choice(doc.get("tool_choice"), tools)
        kwargs = doc.get("chat_template_kwargs") or {}
        expect_object(kwargs, "chat_template_kwargs")
        chat = ChatPart(parse_messages(doc["messages"]), tools=tools if choice != "none" else None,
                        tool_choice=choice, template_kwargs=dict(kwargs))
        return GenerationRequest(model=model, chat=chat, prompt_param="messages")
    key = "content" if "content" in doc else "prompt"
    text = doc.get(key)
    if not isinstance(text, str):
        raise InvalidRequest(f"'{key}' must be a string (or give 'messages'), got {type_name(text)}", param=key)
    return GenerationRequest(model=model, prompt=text, add_special=add_special(doc), prompt_param=key)


def parse_tokenizer_info(params):
    """GET /tokenizer_info's query -> the model named (`?model=`) or None (the default)."""
    return model_name({"model": params["model"]}) if "model" in params else None


def parse_detokenize(doc):
    """-> (model or None, token ids)."""
    expect_object(doc)
    tokens = doc.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in tokens):
        raise InvalidRequest("'tokens' must be an array of non-negative token ids", param="tokens")
    return model_name(doc), tokens


def tokenize_body(ids, max_model_len):
    return {"tokens": list(ids), "count": len(ids), "max_model_len": max_model_len}


def detokenize_body(text):
    return {"prompt": text, "content": text}


def tokenizer_info_body(info, model):
    """vLLM's GET /tokenizer_info: the tokenizer's configuration as transformers names it (what
    lm-eval's RemoteTokenizer reads: eos_token, bos_token, pad_token, chat_template)."""
    return {"tokenizer_class": "TurboSparkTokenizer", "name_or_path": model,
            "bos_token": info.bos_token, "eos_token": info.eos_token, "pad_token": None,
            "add_bos_token": info.add_bos, "add_eos_token": False, "model_max_length": info.max_context,
            "chat_template": info.chat_template or None}
