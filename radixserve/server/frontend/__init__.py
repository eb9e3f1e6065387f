"""The HTTP process: the FastAPI app and its route groups, the request bodies, the TokenizerManager."""
