"""Structured outputs: JSON schema, regex, choice and EBNF constraints compiled by xgrammar.

backend.py (torch-free: specs, compiles off the engine thread) is the front-end's; manager.py (matchers and
their torch bitmask) is the engine's. Import the one you need: this package imports neither.
"""
