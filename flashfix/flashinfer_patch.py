"""Placeholder: patches for flashinfer are declared here."""

PATCHES = ()
