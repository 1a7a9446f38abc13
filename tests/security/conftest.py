"""Security suite: each test drives a real gateway over HTTP (see tests/conftest.py's
`gateway_launcher`) and guards one promise of docs/security.md."""
