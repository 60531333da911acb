"""``tokenwire eval``: checked prompts (cases.py, checks.py) scored per sampling setting with the real
engine (run.py), which is how the server's defaults (server/defaults.py) are chosen."""
