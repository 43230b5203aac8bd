"""TurboSpark WSGI: an OpenAI- and Anthropic-compatible LLM server, a Falcon app under gunicorn.

The folder a module stands in says its job; a request passes them outside in:

    http/       the HTTP edge: workers (framing, early answers), app and middleware, resources (one
                per route family), schemas (wire formats in and out), parsers, sse, the chat page
    serving/    admission and generation: service (the seam), prompts, limits, queue, registry,
                generation (service events), compute (the one engine thread), cancel, and the
                stored responses (response_store)
    engine/     the model: loading, tokenizer, forward pass and kernels, scheduler, sampling
    (here)      entries and operations every room uses: wsgi, cli, config, errors, metrics,
                logsafe, pull

A module imports only from its own layer or below (tests/test_layering.py).
"""
__version__ = "0.1.0"
