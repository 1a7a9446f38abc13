"""rlgate's gateway: the OpenAI-compatible API, the reward API and the admin API."""
