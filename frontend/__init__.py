"""The HTTP door: the Falcon app, auth, the slot lease, SSE."""
