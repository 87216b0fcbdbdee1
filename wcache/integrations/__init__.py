"""Integrations with inference frameworks (each imports its framework lazily)."""
