"""Structured outputs: JSON schema, regex, choice and EBNF constraints compiled by xgrammar."""
from pagedserve.structured_output.backend import GrammarCompileService, GrammarSpec, grammar_spec
from pagedserve.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarCompileService", "GrammarSpec", "StructuredOutputManager", "grammar_spec"]
