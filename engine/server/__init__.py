"""The OpenAI-compatible HTTP server (`engine serve`): FastAPI + uvicorn over one engine thread."""
