"""Placeholder: patches for sglang are declared here."""

PATCHES = ()
