"""Embedding clients against real gunicorn (both worker classes) on all-minilm-l6-v2: the openai
SDK's `embeddings.create` (float and base64) and LangChain's `OpenAIEmbeddings`; each vector equals
the engine's own. Skipped when the model is not pulled."""
import base64
import os
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EMBED_DIR = Path(os.path.expanduser(os.environ.get("TURBOSPARK_MODELS", "~/.cache/turbospark/models"))) / "all-minilm-l6-v2"
M = "all-minilm-l6-v2"
TEXTS = ["The cat sits on the mat.", "Paris is the capital of France.", "東京は日本の首都です。"]


@pytest.fixture(scope="module")
def direct():
    if not (EMBED_DIR / "modules.json").is_file():
        pytest.skip(f"{EMBED_DIR} absent (turbospark pull all-minilm-l6-v2)")
    from turbospark_wsgi.engine.encoder import load_encoder
    enc = load_encoder(str(EMBED_DIR))
    return enc.embed(enc.encode_batch(TEXTS))


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def server(request, tmp_path_factory, start_gunicorn, direct):
    models = tmp_path_factory.mktemp("models")
    (models / M).symlink_to(EMBED_DIR)
    srv = start_gunicorn(request.param, models=str(models), model=M)
    yield srv
    srv.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_openai_sdk_embeddings_create(oai, direct, fmt):
    out = oai.embeddings.create(model=M, input=TEXTS, encoding_format=fmt)
    if fmt == "base64":     # NOTE(sdk): asked for explicitly, the SDK hands the string over as it came
        got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in out.data])
    else:
        got = np.array([d.embedding for d in out.data], dtype=np.float32)
    np.testing.assert_allclose(got, direct, atol=1e-5)
    assert out.model == M and out.usage.prompt_tokens > len(TEXTS)


def test_openai_sdk_default_format_is_base64_and_decodes(oai, direct):
    # NOTE(sdk): with no encoding_format the SDK asks for base64 and decodes it itself
    out = oai.embeddings.create(model=M, input=TEXTS[0])
    np.testing.assert_allclose(np.array(out.data[0].embedding, dtype=np.float32), direct[0], atol=1e-5)


def test_openai_sdk_bad_input_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.embeddings.create(model=M, input=["ok", ""])
    assert err.value.body["param"] == "input"


def test_langchain_openai_embeddings(server, direct):
    emb = langchain_openai.OpenAIEmbeddings(base_url=server.url + "/v1", api_key="x", model=M,
                                            check_embedding_ctx_length=False, max_retries=0, timeout=60)
    docs = np.array(emb.embed_documents(TEXTS), dtype=np.float32)
    np.testing.assert_allclose(docs, direct, atol=1e-5)
    np.testing.assert_allclose(np.array(emb.embed_query(TEXTS[1]), dtype=np.float32), direct[1], atol=1e-5)
