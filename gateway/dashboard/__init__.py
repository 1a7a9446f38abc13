"""The rlgate dashboard: Jinja2 pages, a small SVG chart library, signed-cookie sessions."""
