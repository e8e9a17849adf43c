"""Placeholder: patches for vllm are declared here."""

PATCHES = ()
