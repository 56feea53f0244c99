"""``sclsd-http``: an OpenAI-compatible HTTP front end to a running sclsd.

Its own process (and systemd unit), a client of the daemon's Unix socket
through :class:`sclsd.client.AsyncClient` and of its status socket; several may
run side by side. Built on FastAPI and uvicorn, as vLLM's server is.

* :mod:`.params` (and :mod:`.chat` for messages and tools): an OpenAI request body ->
  the daemon's ``generate`` messages (every parameter checked, anything unknown refused
  by name);
* :mod:`.tokens`: the model's tokenizer in this process, for what the daemon does not do
  (tools, ``suffix``, ``/tokenize``); :mod:`.tools`: tool calls parsed out of the output;
* :mod:`.render` and :mod:`.stream`: the daemon's events -> OpenAI responses, stream
  chunks and errors; :mod:`.generate`: the completion routes;
* :mod:`.link`: the connections to the daemon;
* :mod:`.app`: the routes; :mod:`.openapi`: their schema;
* :mod:`.door` (request ids, access log, counts, body and per-client limits),
  :mod:`.body` (reading JSON within bounds), :mod:`.server` (the header and body
  deadlines, the header bound and the connection cap uvicorn lacks), :mod:`.observe`
  (the front end's metrics);
* :mod:`.cli` and :mod:`.settings`: the command line and the ``[http]`` config.
"""
