"""ASGI middleware and the checks it runs: identity, body limits, quotas, overload."""
