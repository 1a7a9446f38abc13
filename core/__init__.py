"""rlgate's core: settings, process lifetime and the store; imports nothing else of rlgate."""
