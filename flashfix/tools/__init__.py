"""Operator tools: the CLI, doctor, diff, verify and their helpers. Loaded on use, never at import of flashfix."""
