"""`rlgate bench ...`: one module per command, and what they share."""
