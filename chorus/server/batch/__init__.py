"""OpenAI's Batch API behind ``/v1/files`` and ``/v1/batches`` (server/api/openai/files.py, server/api/openai/batches.py): the
store (SQLite and the uploaded files), the input file's checks, the runner that answers the lines through the
app's own routes, and the objects the API returns."""
