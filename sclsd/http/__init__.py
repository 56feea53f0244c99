"""``sclsd-http``: an OpenAI-compatible HTTP front end to a running sclsd.

Its own process (and systemd unit), a client of the daemon's Unix socket
through :class:`sclsd.client.AsyncClient` and of its status socket; several may
run side by side. Built on FastAPI and uvicorn, as vLLM's server is.

* :mod:`.params`: an OpenAI request body -> the daemon's ``generate`` messages
  (every parameter checked, anything unknown refused by name);
* :mod:`.render`: the daemon's events -> OpenAI responses, stream chunks and errors;
* :mod:`.link`: the connections to the daemon;
* :mod:`.app`: the routes; :mod:`.cli`: the command line and the ``[http]`` config.
"""
